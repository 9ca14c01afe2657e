"""The docs follow the code they describe, so they cannot drift from it.

- docs/cli.md documents every option of every subcommand's real parser, in its usage line and its
  table, under the canonical name, and names no option the command does not have;
- every `zerofit CMD ...` command line in README.md and docs/*.md uses only options CMD has, spelt
  canonically (what follows the script of `zerofit launch ... train.py --args` belongs to the script),
  and every complete one in a code block parses;
- the benchmarks/*.sh scripts the docs point to pass only options their commands still have;
- docs/configs.md's table of accepted-and-ignored DeepSpeed keys is `zerofit.config.ignored.TABLE`;
- docs/contributing.md's code map lists exactly the module files under src/zerofit.

The parsers are built as tests/test_cli_flags.py builds them. Everything here reads files and parses
arguments only: no process starts.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
from test_cli_flags import canonical, options, parser_of

from zerofit.cli import flags
from zerofit.cli.main import build_parser
from zerofit.config import ignored

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "cli.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = sorted(next(a for a in build_parser()._actions if a.dest == "command").choices)
OPTION = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*|-[A-Za-z](?![\w-]))")
"""An option as the docs write it: `--num_processes`, `-m` (not `--` alone, not `a-b`, not `[-offload]`)."""
COMMAND_LINE = re.compile(rf"(?:\bzerofit|\./run\.sh) ({'|'.join(COMMANDS)})(?=\s|$)(.*)")
"""`zerofit CMD ...` (or `./run.sh demo ...`); not `zerofit launch: error: ...`."""


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _shown(command: str) -> list[argparse.Action]:
    """The options `--help` lists: no deprecated alias, no hidden test hook."""
    return [a for a in options(parser_of(command))
            if not isinstance(a, flags._DeprecatedAlias) and a.help != argparse.SUPPRESS]


def _names(action: argparse.Action) -> set[str]:
    """The spellings the docs use: the canonical long name and any short option."""
    return {canonical(action)} | {s for s in action.option_strings if not s.startswith("--")}


def _section(command: str) -> str:
    text = _text(CLI_MD)
    start = re.search(rf"^## `zerofit {command}`$", text, flags=re.M)
    assert start, f"docs/cli.md has no section ## `zerofit {command}`"
    end = re.search(r"^## ", text[start.end():], flags=re.M)
    return text[start.end():start.end() + end.start()] if end else text[start.end():]


def _usage(command: str) -> str:
    blocks = re.findall(r"^```\n(.*?)^```", _section(command), flags=re.S | re.M)
    usage = [b for b in blocks if b.startswith(f"zerofit {command} ")]
    assert len(usage) == 1, f"docs/cli.md: `zerofit {command}` needs one usage block (``` without a language)"
    return usage[0]


def _table_options(command: str) -> list[str]:
    """The options named in the first cell of the section's table rows."""
    found = []
    for line in _section(command).splitlines():
        if line.startswith("| `"):
            found += OPTION.findall(line.split("|")[1])
    return found


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_in_the_usage_line_and_the_table(command):
    usage, table = set(OPTION.findall(_usage(command))), set(_table_options(command))
    for action in _shown(command):
        assert usage & _names(action), f"docs/cli.md: the usage of `zerofit {command}` lacks {canonical(action)}"
        for name in _names(action):
            assert name in table, f"docs/cli.md: the table of `zerofit {command}` has no row for {name}"


@pytest.mark.parametrize("command", COMMANDS)
def test_the_reference_names_only_options_the_command_has(command):
    """The usage line, the table and every option the section's prose mentions, in canonical spelling."""
    known = {n for a in _shown(command) for n in _names(a)} | {"-h", "--help"}
    prose = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", _section(command), flags=re.S | re.M))
    mentioned = [o for span in prose if not span.startswith(("python ", "bash ")) and not COMMAND_LINE.search(span)
                 for o in OPTION.findall(span)]  # command lines: test_every_command_line_in_the_docs_...
    for name in [*OPTION.findall(_usage(command)), *_table_options(command), *mentioned]:
        assert name in known, f"docs/cli.md, `zerofit {command}`: {name} is not a canonical option of the command"


def _walk(command: str, args: list[str], *, strict: bool) -> list[str]:
    """Problems with the options in `args` given to `command`: unknown, deprecated, or (strict) not canonical."""
    parser, problems = parser_of(command), []
    i = 0
    while i < len(args):
        token = args[i].split("=", 1)[0]
        i += 1
        if not token.startswith("-") or token == "-":
            if command == "launch":
                break  # the script or module: the rest is its own arguments
            continue
        action = parser._option_string_actions.get(token)
        if action is None:
            problems.append(f"{token} is not an option of zerofit {command}")
            continue
        if isinstance(action, flags._DeprecatedAlias):
            problems.append(f"{token} is deprecated for zerofit {command}: use {action.new_name}")
        elif strict and not isinstance(action, argparse._HelpAction) and token not in _names(action):
            problems.append(f"{token} is not the canonical spelling: write {canonical(action)}")
        if "=" in args[i - 1]:
            continue
        if action.nargs in ("+", "*"):
            while i < len(args) and not args[i].startswith("-"):
                i += 1
        else:
            i += 1 if action.nargs is None else action.nargs
    return problems


def _split(rest: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError:
        return rest.split()


def _command_lines() -> list[tuple[str, str, str, bool]]:
    """(page, command, the rest of the line, whether it is a whole line of a code block)."""
    found = []
    for page in PAGES:
        text = _text(page)
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line)
                for m in COMMAND_LINE.finditer(line):
                    if "[-h]" not in m.group(2):  # a usage line: checked against the parser above
                        found.append((page.name, m.group(1), m.group(2), line.lstrip().startswith(m.group(0))))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", prose):
            for m in COMMAND_LINE.finditer(span.replace("\n", " ")):
                found.append((page.name, m.group(1), m.group(2), False))
    return found


LINES = _command_lines()


def test_the_docs_have_command_lines_to_check():
    assert {command for _, command, _, _ in LINES} == set(COMMANDS)


@pytest.mark.parametrize(("page", "command", "rest", "whole"), LINES,
                         ids=[f"{p}:zerofit {c}{r[:40]}" for p, c, r, _ in LINES])
def test_every_command_line_in_the_docs_uses_canonical_options_the_command_has(page, command, rest, whole):
    assert _walk(command, _split(rest), strict=True) == [], f"{page}: zerofit {command}{rest}"
    if whole and not re.search(r"\b[A-Z]{3,}\b", rest):  # a complete example, not a pattern with placeholders
        try:
            parser_of(command).parse_args(_split(rest))
        except SystemExit:
            pytest.fail(f"{page}: `zerofit {command}{rest}` does not parse")


def _script_lines(script: Path) -> list[tuple[str, str]]:
    text = _text(script).replace("\\\n", " ")
    wrappers = dict(re.findall(r"^\s*(\w+)\(\)\s*\{\s*python3? -m zerofit\.cli\.main (\w+)", text, flags=re.M))
    found = []
    for line in text.splitlines():
        line = re.split(r"\|\||&&|;|\|", line.split(" #")[0])[0]
        m = re.search(r"zerofit\.cli\.main (\w+)(.*)", line)
        w = re.match(rf"^\s*({'|'.join(wrappers) or '(?!)'}) (.*)", line)
        if m and m.group(1) in COMMANDS:
            found.append((m.group(1), m.group(2)))
        elif w:
            found.append((wrappers[w.group(1)], w.group(2)))
    return found


SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_bench_scripts_pass_options_their_commands_have(script):
    """The scripts may use the dashed twins; an unknown or deprecated option is what breaks them."""
    for command, rest in _script_lines(script):
        assert _walk(command, _split(rest), strict=False) == [], f"{script.name}: zerofit {command}{rest}"


def test_the_bench_scripts_call_zerofit():
    assert {c for s in SCRIPTS for c, _ in _script_lines(s)} >= {"bench", "launch"}


def _ignored_section() -> str:
    text = _text(ROOT / "docs" / "configs.md")
    start = text.index("## DeepSpeed keys zerofit accepts but does not use")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_configs_md_lists_every_accepted_and_ignored_key_with_its_default():
    rows = {}
    for line in _ignored_section().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == {entry.key for entry in ignored.TABLE}
    for entry in ignored.TABLE:
        assert rows[entry.key] == f"`{json.dumps(entry.default)}`", entry.key


def _code_map() -> list[str]:
    text = _text(ROOT / "docs" / "contributing.md")
    start = text.index("## Code map")
    end = text.find("\n## ", start + 1)
    prefix, listed = "", []
    for line in text[start:end if end != -1 else None].splitlines():
        if line.startswith("### "):
            packages = re.findall(r"`(\w+/)`", line)
            prefix = packages[0] if len(packages) == 1 else ""
        elif line.startswith("| `"):
            name = line.split("|")[1].strip().strip("`")
            listed.append(name if "/" in name else prefix + name)
    return listed


def test_the_code_map_lists_every_module_file_once():
    listed = _code_map()
    modules = sorted(p.relative_to(ROOT / "src" / "zerofit").as_posix()
                     for p in (ROOT / "src" / "zerofit").rglob("*.py"))
    assert sorted(set(listed)) == sorted(listed), "docs/contributing.md lists a module twice"
    assert sorted(listed) == modules
