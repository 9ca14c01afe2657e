"""The offload rates (`zerofit.plan.bandwidth`): the cache, the time model, and `zerofit env`'s row.

Everything but the last test runs on CPU: `measure` is replaced by fixed rates and the GPU's name by a
fixed one, so the cache and the CLI are exercised as on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch

from zerofit.cli.main import main
from zerofit.plan import bandwidth
from zerofit.plan.bandwidth import Rates, best_host_share, host_seconds, offload_seconds, streamed_seconds

GPU = "NVIDIA H200"

# The H200 box of the offload benchmarks: 55 GB/s each way alone, 49 both at once, fused CPU AdamW
# 0.252 s per 1e9 params alone and 0.388 s beside copies, the GPU kernel 0.006 s (benchmarks/bandwidth_probe.py
# measured 55.3 / 55.4 / 50.2 GB/s, 0.21 / 0.29 s and 0.008 s on such a box).
H200 = Rates(h2d_gbs=55.0, d2h_gbs=55.0, both_gbs=49.0, cpu_adam_s=0.252, cpu_adam_busy_s=0.388, gpu_adam_s=0.006,
             device_name=GPU, torch_version=torch.__version__, host=socket.gethostname(), cpus=16,
             measured_at="2026-12-03T10:00:00+00:00", gpu_tflops=650.0)

H200_NOW = dataclasses.replace(H200, host_copy_gbs=180.0)
"""What this zerofit measures: every rate there (`Rates.current`); an entry without one is measured again."""


def _pcie(gbs: float) -> Rates:
    return dataclasses.replace(H200, h2d_gbs=gbs, d2h_gbs=gbs, both_gbs=gbs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, a CUDA device named GPU, and `measure` counting its calls."""
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "device_name", lambda device=None: GPU)
    calls = []
    monkeypatch.setattr(bandwidth, "measure", lambda device=None: calls.append(device) or H200_NOW)
    return calls


# -- the cache ---------------------------------------------------------------------------------------

def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bandwidth.cache_path() == tmp_path / "own" / "bandwidth.json"
    monkeypatch.delenv("ZEROFIT_CACHE_DIR")
    assert bandwidth.cache_path() == tmp_path / "xdg" / "zerofit" / "bandwidth.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG spec says to ignore a relative one
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bandwidth.cache_path() == tmp_path / "home" / ".cache" / "zerofit" / "bandwidth.json"


def test_probe_measures_once_then_reads_the_cache(cache):
    assert bandwidth.cached() is None
    assert bandwidth.probe() == H200_NOW and len(cache) == 1
    assert bandwidth.cached() == H200_NOW
    assert bandwidth.probe() == H200_NOW and len(cache) == 1  # from the file
    assert bandwidth.probe(refresh=True) == H200_NOW and len(cache) == 2
    data = json.loads(bandwidth.cache_path().read_text())
    assert data["format"] == 1 and data["entries"] == [H200_NOW.to_json()]  # refreshed in place, not appended
    assert not [p for p in bandwidth.cache_path().parent.iterdir() if p.name != "bandwidth.json"]  # no temp left


def test_an_older_entry_without_a_rate_is_measured_again(cache):
    bandwidth.store(H200)  # an older zerofit's: no host memory copy rate
    assert bandwidth.cached() == H200 and not H200.current
    assert bandwidth.probe() == H200_NOW and len(cache) == 1 and bandwidth.cached() == H200_NOW


def test_json_round_trip_is_exact():
    assert Rates.from_json(json.loads(json.dumps(H200.to_json()))) == H200
    unmeasured = dataclasses.replace(H200, cpu_adam_busy_s=None)
    assert Rates.from_json(json.loads(json.dumps(unmeasured.to_json()))) == unmeasured


def test_entries_are_keyed_by_host_gpu_and_torch_version(cache, monkeypatch):
    others = [dataclasses.replace(H200, device_name="NVIDIA A100-SXM4-80GB", h2d_gbs=20.0),
              dataclasses.replace(H200, host="another-host", h2d_gbs=21.0),
              dataclasses.replace(H200, torch_version="0.0.1-other", h2d_gbs=22.0)]
    for other in others:
        assert bandwidth.store(other)
    assert bandwidth.cached() is None  # none of them is this (host, GPU, torch)
    bandwidth.probe()
    monkeypatch.setattr(bandwidth, "device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert bandwidth.cached().h2d_gbs == 20.0
    assert len(json.loads(bandwidth.cache_path().read_text())["entries"]) == 4


def test_the_cache_keeps_the_newest_entries_only(cache):
    for i in range(bandwidth.MAX_CACHE_ENTRIES + 5):
        bandwidth.store(dataclasses.replace(H200, host=f"host-{i}"))
    hosts = [e["host"] for e in json.loads(bandwidth.cache_path().read_text())["entries"]]
    assert hosts == [f"host-{i}" for i in range(5, bandwidth.MAX_CACHE_ENTRIES + 5)]


def test_no_cuda_device_means_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "device_name", lambda device=None: None)
    bandwidth.store(H200)
    assert bandwidth.cached() is None


def test_device_name_is_none_off_cuda():
    assert bandwidth.device_name("cpu") is None and bandwidth.device_name("meta") is None
    assert bandwidth.device_name("no-such-device") is None
    if not torch.cuda.is_available():
        assert bandwidth.device_name() is None


GOOD = {"format": 1, "entries": [H200.to_json()]}
BAD_FILES = {
    "not JSON": b"{ not json",
    "not UTF-8": b"\xff\xfe\x00",
    "empty": b"",
    "a list": b"[]",
    "another format": json.dumps({**GOOD, "format": 2}).encode(),
    "entries not a list": json.dumps({"format": 1, "entries": {"a": 1}}).encode(),
    "an entry with an unknown key": json.dumps({"format": 1, "entries": [{**H200.to_json(), "x": 1}]}).encode(),
    "an entry missing a key": json.dumps({"format": 1, "entries": [{k: v for k, v in H200.to_json().items()
                                                                    if k != "cpus"}]}).encode(),
    "a zero rate": json.dumps({"format": 1, "entries": [{**H200.to_json(), "both_gbs": 0}]}).encode(),
    "a string rate": json.dumps({"format": 1, "entries": [{**H200.to_json(), "h2d_gbs": "fast"}]}).encode(),
    "a NaN rate": json.dumps({"format": 1, "entries": [{**H200.to_json(), "gpu_adam_s": float("nan")}]}).encode(),
    "an entry not an object": json.dumps({"format": 1, "entries": [1, None, "x"]}).encode(),
    "nested too deeply": b"[" * 100_000 + b"]" * 100_000,
    "over 1 MiB": json.dumps({**GOOD, "pad": "x" * (1 << 20)}).encode(),
}


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_cache_file_is_a_miss_not_an_error(cache, content):
    path = bandwidth.cache_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert bandwidth.cached() is None
    assert bandwidth.probe() == H200_NOW and len(cache) == 1  # measured, and the file replaced by a good one
    assert bandwidth.cached() == H200_NOW


def test_a_directory_or_a_fifo_in_place_of_the_file_is_a_miss(cache):
    path = bandwidth.cache_path()
    path.mkdir(parents=True)
    assert bandwidth.cached() is None
    assert bandwidth.probe() == H200_NOW  # cannot replace a directory: the rates come back all the same
    path.rmdir()
    os.mkfifo(path)  # would block a plain open() for ever
    assert bandwidth.cached() is None


def test_a_good_entry_survives_a_bad_neighbour(cache):
    path = bandwidth.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "entries": [{"junk": 1}, H200.to_json()]}))
    assert bandwidth.cached() == H200


def test_a_cache_that_cannot_be_written_still_returns_the_rates(cache, tmp_path, monkeypatch, caplog):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o500)
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(readonly / "zerofit"))
    try:
        if os.access(readonly, os.W_OK):  # root ignores the mode bits: a file in place of the directory then
            readonly.chmod(0o700)
            (readonly / "zerofit").write_text("a file, not a directory")
        assert bandwidth.probe() == H200_NOW and len(cache) == 1
        assert bandwidth.cached() is None
        assert "could not cache the offload rates" in caplog.text and "ZEROFIT_CACHE_DIR" in caplog.text
    finally:
        readonly.chmod(0o700)


@pytest.mark.parametrize(("change", "message"), [
    ({"h2d_gbs": 0.0}, r"Rates.h2d_gbs must be a finite number > 0 \(got 0.0\)"),
    ({"cpu_adam_busy_s": -1.0}, r"Rates.cpu_adam_busy_s must be a finite number > 0"),
    ({"gpu_adam_s": True}, r"Rates.gpu_adam_s must be a finite number > 0 \(got True\)"),
    ({"device_name": ""}, r"Rates.device_name must be a non-empty string"),
    ({"cpus": 0}, r"Rates.cpus must be an integer >= 1 \(got 0\)"),
])
def test_rates_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(H200, **change)


def test_from_json_names_the_wrong_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['x'\], missing keys \['cpus'\]"):
        Rates.from_json({**{k: v for k, v in H200.to_json().items() if k != "cpus"}, "x": 1})
    with pytest.raises(ValueError, match="must be a JSON object"):
        Rates.from_json([1])


def test_summary_is_one_short_line():
    assert H200.summary() == ("h2d 55.0 / d2h 55.0 / both 49.0 GB/s; CPU AdamW 0.25 s (0.39 s beside copies), "
                              "GPU AdamW 0.006 s per 1e9 params; bf16 matmul 650 TFLOP/s (measured 2026-12-03)")
    assert "beside copies" not in dataclasses.replace(H200, cpu_adam_busy_s=None).summary()
    assert "matmul" not in dataclasses.replace(H200, gpu_tflops=None).summary()
    assert dataclasses.replace(H200, host_copy_gbs=180.4).summary().endswith(
        "; host memory copy 180 GB/s (measured 2026-12-03)")


# -- measuring ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_measure_off_cuda_is_a_clear_error(device):
    with pytest.raises(ValueError, match="no accelerator: nothing to measure"):
        bandwidth.measure(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_measure_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no accelerator: nothing to measure \(device 'cuda'"):
        bandwidth.measure()
    with pytest.raises(ValueError, match="no accelerator"):
        bandwidth.probe(refresh=True)


def test_the_cpu_adamw_timer_runs_on_this_torch():
    """The one piece of `measure` that needs no GPU: torch's fused CPU AdamW, timed."""
    step = bandwidth._cpu_adam_stepper(1 << 12)
    assert 0 < step() < 10


def test_the_host_memory_copy_runs_on_this_torch(monkeypatch):
    monkeypatch.setattr(bandwidth, "HOST_COPY_BYTES", 1 << 20)
    assert 0 < bandwidth._host_copy_gbs() < 1e5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_on_the_gpu_gives_plausible_rates():
    rates = bandwidth.measure()
    assert 1 < rates.h2d_gbs < 1000 and 1 < rates.d2h_gbs < 1000 and 1 < rates.both_gbs < 1000
    assert 0 < rates.gpu_adam_s < rates.cpu_adam_s
    assert 1 < rates.host_copy_gbs < 10_000
    assert rates.device_name == torch.cuda.get_device_name()


# -- the time model ----------------------------------------------------------------------------------

def test_streamed_seconds_is_the_copies_or_the_kernel():
    # 1e9 params, AdamW (k=2): 12 GB each way at 49 GB/s; the kernel's 0.006 s hides under it.
    assert streamed_seconds(H200, 10**9) == pytest.approx(12 / 49)
    assert streamed_seconds(H200, 10**9, state_tensors=1) == pytest.approx(8 / 49)
    slow_kernel = dataclasses.replace(H200, gpu_adam_s=0.5)
    assert streamed_seconds(slow_kernel, 10**9) == pytest.approx(0.5)
    assert streamed_seconds(H200, 0) == 0


def test_host_seconds_is_the_cpu_or_its_copies():
    # CPU: 0.252 s alone, 0.388 s busy; copies: 4 B gradient down (the larger direction) at 49 GB/s.
    assert host_seconds(H200, 10**9) == pytest.approx(0.252)
    assert host_seconds(H200, 10**9, busy=True) == pytest.approx(0.388)
    assert host_seconds(_pcie(5.0), 10**9) == pytest.approx(4 / 5)
    assert host_seconds(_pcie(5.0), 10**9, grad_bytes=2) == pytest.approx(2 / 5)
    assert host_seconds(_pcie(5.0), 10**9, grad_bytes=2, param_bytes=3) == pytest.approx(3 / 5)
    unmeasured = dataclasses.replace(H200, cpu_adam_busy_s=None)  # the alone rate stands in
    assert host_seconds(unmeasured, 10**9, busy=True) == pytest.approx(0.252)


def test_offload_seconds_adds_both_parts_on_the_link():
    n = 10**9
    assert offload_seconds(H200, n, 0) == pytest.approx(streamed_seconds(H200, n))
    assert offload_seconds(H200, 0, n) == pytest.approx(host_seconds(H200, n, busy=True))
    # Half and half: CPU 0.388 * 0.5 = 0.194 s; down 12 * 0.5 + 4 * 0.5 = 8 GB, up 12 * 0.5 + 2 * 0.5 = 7 GB,
    # so the link takes 8 / 49 = 0.163 s: the CPU is the longer.
    assert offload_seconds(H200, n // 2, n // 2) == pytest.approx(0.194)
    # At 12 GB/s the link is the longer: 8 / 12.
    assert offload_seconds(_pcie(12.0), n // 2, n // 2) == pytest.approx(8 / 12)


def test_best_host_share_on_the_h200_figures_is_a_split():
    """Streaming everything takes 12 / 49 = 0.245 s per 1e9 params, host-stepping everything 0.388 s; moving a
    share s to the host frees the link (12 - 8s GB down) while the CPU takes 0.388 s: they meet at
    s = 12 / (0.388 * 49 + 8) = 0.444, so the model picks 0.45 of the grid: max(0.1746, 8.4 / 49 = 0.1714)
    = 0.175 s, against 0.40's max(0.155, 8.8 / 49 = 0.180) and 0.50's 0.194. On these figures the model
    says that a split beats both ways of stepping."""
    assert best_host_share(H200, 10**9) == 0.45
    assert offload_seconds(H200, 55 * 10**7, 45 * 10**7) == pytest.approx(0.388 * 0.45)


def test_best_host_share_follows_the_link():
    # 12 GB/s: streaming 1.0 s, host 0.388 s (CPU-bound: 4 / 12 = 0.333 for the copies); they meet at
    # s = 12 / (0.388 * 12 + 8) = 0.947, so 0.95: max(0.369, 4.4 / 12 = 0.367) = 0.369 s, within 10 % of
    # all on the host (0.388 s): the model's margin (SPLIT_MIN_GAIN) says all on the host.
    assert best_host_share(_pcie(12.0), 10**9) == 1.0
    # 1 GB/s: the link bounds every share (4 B per host-stepped param, 12 per streamed), so all on the host.
    assert best_host_share(_pcie(1.0), 10**9) == 1.0
    # A CPU far slower than the link: 5 s per 1e9 params makes even 5% (0.25 s) slower than streaming.
    assert best_host_share(dataclasses.replace(H200, cpu_adam_busy_s=5.0), 10**9) == 0.0


def test_a_link_slowed_by_the_cpu_leaves_no_split_worth_taking():
    """The H200 box measured: the link each way falls from 50 to 34 GB/s while the CPU steps. Streaming
    everything: 12 / 50 = 0.240 s per 1e9 params. A share s on the host: max(0.43 s, (12 - 8 s) / 34); the
    best, s = 0.5, takes 0.235 s: 2 % ahead, inside the model's 10 % margin, so no split (the split measured
    on that box ran 0-6 % behind)."""
    measured = dataclasses.replace(H200, both_gbs=50.0, cpu_adam_busy_s=0.43, both_busy_gbs=34.0)
    assert offload_seconds(measured, 10**9, 0) == pytest.approx(0.24)
    assert offload_seconds(measured, 5 * 10**8, 5 * 10**8) == pytest.approx(8 / 34)
    assert best_host_share(measured, 10**9) == 0.0
    # where the link keeps its rate beside the CPU, the split is taken
    assert best_host_share(dataclasses.replace(measured, both_busy_gbs=50.0), 10**9) > 0


def test_best_host_share_breaks_ties_towards_the_gpu():
    assert best_host_share(H200, 0) == 0.0  # every share costs nothing
    # A GPU kernel and a CPU of 1 s per 1e9 params each: all streamed and all on the host both take 1 s.
    tie = dataclasses.replace(H200, gpu_adam_s=1.0, cpu_adam_busy_s=1.0)
    assert offload_seconds(tie, 10**9, 0) == offload_seconds(tie, 0, 10**9) == 1.0
    assert best_host_share(tie, 10**9, steps=1) == 0.0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: streamed_seconds(H200, -1), r"numel must be an integer >= 0 \(got -1\)"),
    (lambda: streamed_seconds(H200, 1, state_tensors=-2), "state_tensors must be an integer >= 0"),
    (lambda: host_seconds(H200, 1.5), r"numel must be an integer >= 0 \(got 1.5\)"),
    (lambda: host_seconds(H200, 1, grad_bytes=-4), "grad_bytes must be an integer >= 0"),
    (lambda: offload_seconds(H200, 1, -1), "numel_host must be an integer >= 0"),
    (lambda: offload_seconds(H200, 1, 1, param_bytes=-1), "param_bytes must be an integer >= 0"),
    (lambda: best_host_share(H200, 10, steps=0), r"steps must be an integer >= 1 \(got 0\)"),
])
def test_the_model_rejects_negative_counts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- zerofit env -------------------------------------------------------------------------------------

def _row(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("offload rates: "))


def test_env_says_not_measured_with_an_empty_cache(cache, capsys):
    assert main(["env"]) == 0
    assert _row(capsys.readouterr().out) == \
        "offload rates: not measured: `zerofit env --probe` measures them (a few seconds)"
    assert not cache  # showing the row never measures


def test_env_shows_the_cached_rates(cache, capsys):
    bandwidth.store(H200)
    assert main(["env"]) == 0
    assert _row(capsys.readouterr().out) == f"offload rates: {H200.summary()}"
    assert not cache


def test_env_probe_measures_caches_and_shows(cache, capsys):
    bandwidth.store(dataclasses.replace(H200, h2d_gbs=1.0))  # an old measurement: --probe replaces it
    assert main(["env", "--probe"]) == 0
    captured = capsys.readouterr()
    assert _row(captured.out) == f"offload rates: {H200_NOW.summary()}" and "measuring" in captured.err
    assert len(cache) == 1 and bandwidth.cached() == H200_NOW


def test_env_probe_says_when_it_could_not_cache(cache, capsys, monkeypatch):
    monkeypatch.setattr(bandwidth, "store", lambda rates: False)
    assert main(["env", "--probe"]) == 0
    assert _row(capsys.readouterr().out).endswith("bandwidth.json could not be written)")


def test_env_without_cuda_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "device_name", lambda device=None: None)
    assert main(["env"]) == 0
    assert _row(capsys.readouterr().out) == "offload rates: no CUDA device"


def test_env_probe_without_cuda_fails_clearly(monkeypatch, capsys, tmp_path):
    """Asked to measure with nothing to measure: status 2 and a message, so scripts notice; nothing measured."""
    monkeypatch.setenv("ZEROFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bandwidth, "device_name", lambda device=None: None)
    monkeypatch.setattr(bandwidth, "measure", lambda device=None: pytest.fail("measured without a GPU"))
    assert main(["env", "--probe"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("zerofit env: error: --probe measures") and "torch sees none" in captured.err
