"""The README and docs/ hold up: every config example loads, every relative link resolves, and the
README's two commands are the ones run.sh and CI run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from zerofit.config import ScriptFacts, load_config, resolve_auto
from zerofit.config.schema import is_auto, to_dict
from zerofit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
TEXT = {page: page.read_text(encoding="utf-8") for page in PAGES}


def _blocks(page: Path) -> list[tuple[str, str]]:
    return re.findall(r"^```(yaml|json)\n(.*?)^```", TEXT[page], flags=re.S | re.M)


BLOCKS = [(page, kind, text) for page in PAGES for kind, text in _blocks(page)]
BLOCK_IDS = [f"{page.relative_to(ROOT)}:{i}" for page in PAGES for i in range(len(_blocks(page)))]


def _load(kind: str, text: str, tmp_path: Path):
    path = tmp_path / f"example.{kind}"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_docs_exist():
    names = {page.name for page in DOCS}
    assert {"configs.md", "cli.md", "engine.md", "benchmarks.md", "recipes.md", "contributing.md"} <= names


@pytest.mark.parametrize(("page", "kind", "text"), BLOCKS, ids=BLOCK_IDS)
def test_every_config_example_loads(page, kind, text, tmp_path):
    cfg = _load(kind, text, tmp_path)
    stage = re.search(r"(?:stage|zero_stage)\"?: \"?(\d|auto)", text)
    assert stage, f"{page.name}: a config example that names no stage"
    if stage.group(1) == "auto":
        assert is_auto(cfg.zero.stage) and is_auto(cfg.zero.offload_optimizer.device)
    else:
        assert cfg.zero.stage == int(stage.group(1))


def test_the_readme_has_one_config_example_per_format(tmp_path):
    blocks = _blocks(README)
    accelerate = [t for k, t in blocks if k == "yaml" and "distributed_type: DEEPSPEED" in t]
    zerofit = [t for k, t in blocks if k == "yaml" and "distributed_type" not in t]
    deepspeed = [t for k, t in blocks if k == "json"]
    assert accelerate and zerofit and deepspeed
    accelerate_cfg, zerofit_cfg = _load("yaml", accelerate[0], tmp_path), _load("yaml", zerofit[0], tmp_path)
    assert accelerate_cfg.source_format != zerofit_cfg.source_format


def _same_setting_blocks() -> list[tuple[str, str]]:
    """The config blocks under the README's "Configs: one setting, three formats" heading."""
    section = TEXT[README].split("## Configs: one setting, three formats", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(yaml|json)\n(.*?)^```", section, flags=re.S | re.M)


def test_the_readmes_three_formats_resolve_to_the_same_settings(tmp_path):
    """The README promises "each file loads to the same settings": once the script's facts fill every
    "auto", the three configs must be one config (only where each came from differs)."""
    blocks = _same_setting_blocks()
    assert [kind for kind, _ in blocks] == ["yaml", "yaml", "json"]
    facts = ScriptFacts(micro_batch_size=4, gradient_accumulation_steps=2, num_processes=2, hidden_size=64)
    resolved = []
    for i, (kind, text) in enumerate(blocks):
        path = tmp_path / f"format{i}.{kind}"
        path.write_text(text, encoding="utf-8")
        settings = to_dict(resolve_auto(load_config(path), facts))
        del settings["source"], settings["source_format"]
        resolved.append(settings)
    assert {load_config(tmp_path / f"format{i}.{k}").source_format for i, (k, _) in enumerate(blocks)} == {
        "zerofit", "accelerate", "deepspeed"}
    assert resolved[1] == resolved[0], "the Accelerate YAML differs from the zerofit YAML"
    assert resolved[2] == resolved[0], "the DeepSpeed JSON differs from the zerofit YAML"


NVME_CONFIGS = sorted((ROOT / "examples" / "configs").glob("*/zero3_nvme.*"))


@pytest.mark.parametrize("path", NVME_CONFIGS, ids=[p.parent.name for p in NVME_CONFIGS])
def test_the_nvme_recipe_configs_are_what_recipes_md_says(path, tmp_path):
    """docs/recipes.md: optimizer state on NVMe, parameters on the CPU; parameters on NVMe are refused
    when the config is loaded (not at prepare())."""
    cfg = load_config(path)
    assert (cfg.zero.offload_optimizer.device, cfg.zero.offload_param.device) == ("nvme", "cpu")
    text = TEXT[ROOT / "docs" / "recipes.md"]
    assert "put the optimizer state on NVMe" in text and "refused when it is loaded" in text
    data = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML
    if "deepspeed_config" in data:
        data["deepspeed_config"]["offload_param_device"] = "nvme"
    else:
        section = data.get("zero") or data["zero_optimization"]
        section["offload_param"]["device"] = "nvme"
    param_on_nvme = tmp_path / path.name
    param_on_nvme.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"offload_param.* 'nvme' is not supported: .*set it to cpu"):
        load_config(param_on_nvme)


def _setting(cfg) -> str:
    z = cfg.zero
    if is_auto(z.stage):
        return "auto"
    opt, param = z.offload_optimizer.device, z.offload_param.device
    if z.stage == 3 and opt == "nvme":
        return "3+nvme"
    if z.stage == 3 and opt == "cpu" and param == "cpu":
        return "3+cpu"
    if z.stage == 2 and opt == "cpu" and param == "none":
        return "2+opt"
    if opt == "none" and param == "none":
        return str(z.stage)
    return f"{z.stage} {opt} {param}"


def test_configs_md_has_an_example_for_every_stage(tmp_path):
    found = {_setting(_load(k, t, tmp_path)) for k, t in _blocks(ROOT / "docs" / "configs.md")}
    assert {"0", "1", "2", "2+opt", "3", "3+cpu", "3+nvme", "auto"} <= found


def test_configs_md_keeps_the_ignored_keys_section():
    assert "## DeepSpeed keys zerofit accepts but does not use" in TEXT[ROOT / "docs" / "configs.md"]


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", TEXT[page], flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


LINKS = [
    (page, target)
    for page in PAGES
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", TEXT[page], flags=re.S | re.M))
    if not re.match(r"[a-z]+:", target)
]


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS])
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor:
        assert dest.suffix == ".md", f"{page.relative_to(ROOT)}: {target} has an anchor but is no page"
        assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading for {target}"


def test_the_readme_links_every_doc():
    for page in DOCS:
        assert f"](docs/{page.name})" in TEXT[README], f"README.md does not link docs/{page.name}"


def test_the_readme_commands_are_what_ci_runs():
    readme = TEXT[README]
    assert "./run.sh demo" in readme and "./run.sh test" in readme
    assert "./run.sh test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pytest -x -q" in (ROOT / "run.sh").read_text(encoding="utf-8")


FAKE_PYTHON = """#!/bin/sh
# `python -m venv DIR`: a venv whose python has no torch and whose pip "installs" by logging (and, for
# zerofit, by writing a bin/zerofit that echoes its arguments)
venv="$3"
mkdir -p "$venv/bin"
cat > "$venv/bin/python" <<PY
#!/bin/sh
case "\\$1" in
  -c) exit 1 ;;
  -m) echo "pip \\$*" >> "$venv/log"
      case "\\$*" in
        *"-e "*) printf '#!/bin/sh\\necho zerofit "\\$@"\\n' > "$venv/bin/zerofit"; chmod +x "$venv/bin/zerofit" ;;
      esac ;;
esac
PY
chmod +x "$venv/bin/python"
"""


def test_run_sh_says_what_it_does_while_it_installs(tmp_path):
    """The first `./run.sh demo` spends minutes in a quiet pip: it says so, on stderr, then runs the demo;
    the next run is quiet."""
    import os
    import platform
    import stat
    import subprocess

    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHON": str(fake), "ZEROFIT_VENV": str(tmp_path / "venv")}
    first = subprocess.run(["bash", str(ROOT / "run.sh"), "demo", "--steps", "1"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert first.returncode == 0, first.stderr
    torch_pin = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / "run.sh").read_text(encoding="utf-8"), flags=re.M)[1]
    linux_x86 = (platform.system(), platform.machine()) == ("Linux", "x86_64")  # where triton is installed too
    assert first.stderr.splitlines() == [
        f"run.sh: creating {tmp_path / 'venv'} with torch {torch_pin} and zerofit (first run only, a few minutes)...",
        f"run.sh: installing torch {torch_pin}...",
        *(["run.sh: installing triton (the fused kernels' CPU check)..."] if linux_x86 else []),
        "run.sh: installing zerofit (editable) with its dev, examples, bench, trainer and trackers extras...",
        f"run.sh: {tmp_path / 'venv'} is ready; later runs reuse it",
    ]
    assert ("install triton==" in (tmp_path / "venv" / "log").read_text()) == linux_x86
    assert first.stdout == "zerofit demo --steps 1\n"
    assert f"install torch=={torch_pin}" in (tmp_path / "venv" / "log").read_text()
    again = subprocess.run(["bash", str(ROOT / "run.sh"), "demo"], capture_output=True, text=True, env=env, timeout=60)
    assert (again.returncode, again.stdout, again.stderr) == (0, "zerofit demo\n", "")
