"""benchmarks/compare_peers.py in --quick --tiny mode: the JSON it saves is well-formed and consistent.

Not a speed test (speed is only claimed as ratios from a real run, see docs/performance.md). What must
hold for the comparison to be fair: every peer produced the same number of tokens for a workload,
the ratios are the throughputs divided, and octavo's greedy tokens are HF transformers' greedy tokens
for the same requests (so is HF's own padded static batch, and onnxruntime-genai when it ran).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("compare_peers")
    out = tmp / "result.json"
    cmd = [sys.executable, "-m", "benchmarks.compare_peers", "--quick", "--tiny", "--workdir", str(tmp / "work"),
           "--json", str(out), "--peers", "octavo,hf,genai,llamacpp", "--llama-server", ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "octavo/peer" in proc.stdout and "targets:" in proc.stdout
    return json.loads(out.read_text())


def test_every_peer_made_the_workloads_tokens(report: dict) -> None:
    wanted = {w["name"]: w["output_tokens"] for w in report["workloads"]}
    ran = [r for r in report["results"] if r["error"] is None]
    peers = {r["peer"] for r in ran}
    assert {"octavo", "octavo (no prefix cache)", "hf-sequential", "hf-static-batch"} <= peers
    for r in ran:
        assert r["output_tokens"] == wanted[r["workload"]], r["peer"]
        assert r["num_requests"] == len(r["outputs"])
        assert r["elapsed_s"] > 0
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
    for name, row in report["table"].items():  # every workload ran on octavo and on both HF variants
        assert {"octavo", "hf-sequential", "hf-static-batch"} <= set(row), name


def test_ratios_are_throughputs_divided(report: dict) -> None:
    for name, row in report["table"].items():
        ours = row["octavo"]["output_tok_s"]
        for peer, e in row.items():
            if e["ok"]:
                assert e["octavo_over_peer"] == pytest.approx(ours / e["output_tok_s"]), (name, peer)
    big = report["workloads"][1]["name"]
    assert report["targets"][f"{big}: octavo / HF static batch >= 2.5"] == pytest.approx(
        report["table"][big]["hf-static-batch"]["octavo_over_peer"])


def test_octavo_greedy_tokens_equal_hf(report: dict) -> None:
    by = {(r["peer"], r["workload"]): r for r in report["results"] if r["error"] is None}
    for name in report["table"]:
        hf = by[("hf-sequential", name)]["outputs"]
        assert by[("octavo", name)]["outputs"] == hf, name
        assert by[("hf-static-batch", name)]["outputs"] == hf, name
        if ("octavo (no prefix cache)", name) in by:
            assert by[("octavo (no prefix cache)", name)]["outputs"] == hf, name
        if ("onnxruntime-genai", name) in by:
            assert by[("onnxruntime-genai", name)]["outputs"] == hf, name
        assert report["table"][name]["octavo"]["agreement_with_hf"] == 1.0


def test_prefix_cache_hits_only_with_the_cache_on(report: dict) -> None:
    by = {(r["peer"], r["workload"]): r for r in report["results"] if r["error"] is None}
    shared = next(w for w in report["workloads"] if w["name"] == "shared-prefix")
    assert by[("octavo", "shared-prefix")]["extra"]["prefix_cache_hit_tokens"] >= shared["num_requests"] * 48
    assert by[("octavo (no prefix cache)", "shared-prefix")]["extra"]["prefix_cache_hit_tokens"] == 0
    assert by[("octavo", "seed10")]["extra"]["prefix_cache_hit_tokens"] == 0  # random prompts share nothing


def test_what_was_not_measured_is_said(report: dict) -> None:
    targets = report["targets"]
    assert len(targets) == 9
    llama = [k for k in targets if "llama-server" in k]
    assert llama and all(targets[k] is None for k in llama)  # no binary given
    assert any("llama.cpp not run" in n for n in report["notes"])
    genai = [r for r in report["results"] if r["peer"] == "onnxruntime-genai"]
    assert genai and all(r["error"] is None or r["error"] for r in genai)  # ran, or says why not


def test_roofline_profile_and_online(report: dict) -> None:
    roof = report["roofline"]
    assert roof["sgemm_gflops"] > 0 and roof["copy_gbs"] > 0 and roof["step_ms_batch"] > 0
    assert roof["batch_vs_peak"] == pytest.approx(roof["achieved_gflops_batch"] / roof["sgemm_gflops"])
    assert sum(roof["op_share_batch"].values()) == pytest.approx(1.0)
    assert "PagedAttention" in roof["op_share_batch"]
    prof = report["engine_profile"]["summaries"][0]
    assert prof["steps"] > 0 and prof["seconds"]["backend"] > 0
    assert sum(prof["seconds"].values()) == pytest.approx(prof["total"], rel=1e-6)
    (online,) = report["online"]
    assert online["error"] is None and online["extra"]["completed"] == online["num_requests"]
    assert online["extra"]["p50_ttft_ms"] > 0


def test_llama_target_uses_the_best_np_row() -> None:
    """Several -np rows: the target ratio is octavo over the fastest of them, and that -np serves online."""
    from benchmarks import compare_peers as cp
    from benchmarks.peers.result import PeerResult, compare

    rows = [PeerResult("octavo", "random64", 64, 100, output_tokens=1000, elapsed_s=2.0)]
    for np_, secs in ((16, 5.0), (32, 4.0), (64, 8.0)):
        r = PeerResult(f"{cp.LLAMA} -np {np_}", "random64", 64, 100, output_tokens=1000, elapsed_s=secs)
        r.extra = {"slots": np_}
        rows.append(r)
    assert cp.best_llama_np(rows, "random64", [16, 32, 64]) == 32
    assert cp.best_llama_np(rows[:1], "random64", [16, 32, 64]) == 16  # none ran: the first candidate
    table = compare(rows)
    seed = cp.IdWorkload("seed10", [])
    shared = cp.IdWorkload("shared-prefix", [])
    checks = cp.targets(table, [seed, cp.IdWorkload("random64", [])], shared, None, [], rows)
    assert checks["random64: octavo / llama-server (best -np) >= 1.3"] == pytest.approx(2.0)


def test_perf_gguf_is_loadable_by_llama_cpp_tokenizer_rules(tmp_path: Path) -> None:
    """llama.cpp refuses a byte-level BPE vocabulary without tokenizer.ggml.merges, and GGUF cannot store an
    empty array: the perf tokenizer must carry at least one merge, and the GGUF must hold it."""
    import gguf

    from benchmarks.peers.model import PerfModelConfig, prepare_models

    models = prepare_models(tmp_path, PerfModelConfig.tiny(), genai=False, gguf=True)
    assert models.gguf_error is None and models.gguf_path is not None
    reader = gguf.GGUFReader(str(models.gguf_path))
    field = reader.fields.get("tokenizer.ggml.merges")
    assert field is not None and len(field.data) >= 1
    assert str(bytes(reader.fields["tokenizer.ggml.model"].parts[-1]), "utf-8") == "gpt2"


def test_load_time_and_peak_memory_per_peer(report: dict) -> None:
    res = report["resources"]
    ran = {r["peer"] for r in report["results"] if r["error"] is None}
    assert ran <= set(res)
    for peer in ran:
        assert res[peer]["load_s"] is not None and res[peer]["load_s"] > 0, peer
        assert res[peer]["peak_rss_mib"] is not None and res[peer]["peak_rss_mib"] > 20, peer  # a real process


HAS_PROC = Path("/proc/self/status").is_file()
# A process that holds MIB MiB of touched pages (b"\x01" * n writes every page), says so on stdout and
# then waits until its stdin is closed.
HOLD = "import sys\nbuf = b'\\x01' * ({mib} << 20)\nprint('ready', flush=True)\nsys.stdin.read()\n"


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_peak_rss_is_the_childs_own_not_inherited_from_its_parent() -> None:
    """The bug behind "1979 MiB for every peer": a parent that once held ~300 MiB (freed again before it
    starts the child) starts a child. The child's getrusage ru_maxrss says 300+ MiB, because Linux carries
    the old address space's high-water mark across exec. own_peak_mib (VmHWM) reads the child's own few
    tens of MiB."""
    child = ("import json, resource\nfrom benchmarks.peers.memory import own_peak_mib\n"
             "print(json.dumps({'own': own_peak_mib(), 'ru_maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")
    parent = (f"import subprocess, sys\nbuf = b'\\x01' * (300 << 20)\ndel buf\n"
              f"sys.stdout.write(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True).stdout)\n")
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["ru_maxrss"] >= 300, seen  # inherited: the parent's peak, not the child's
    assert 5 < seen["own"] < 150, seen  # the child's interpreter and one small import


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_tree_peak_sums_a_server_and_its_child() -> None:
    """tree_peak_mib of a process holding N MiB whose own child holds N MiB reads at least 2N (VmHWM
    summed over the tree), and the child alone at least N but less than 2N. Both are read while the
    processes still hold their memory: each one says 'ready' on a pipe first."""
    from benchmarks.peers.memory import descendants, tree_peak_mib

    n = 64
    server = (f"import subprocess, sys\nbuf = b'\\x01' * ({n} << 20)\n"
              f"g = subprocess.Popen([sys.executable, '-c', {HOLD.format(mib=n)!r}], stdin=subprocess.PIPE, "
              "stdout=subprocess.PIPE, text=True)\n"
              "assert g.stdout.readline() == 'ready\\n'\nprint('ready', g.pid, flush=True)\n"
              "sys.stdin.read()\ng.stdin.close()\ng.wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", server], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        word, pid = proc.stdout.readline().split()
        assert word == "ready"
        assert descendants(proc.pid) == [int(pid)]
        tree, grandchild = tree_peak_mib(proc.pid), tree_peak_mib(int(pid))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert grandchild is not None and n <= grandchild < 2 * n, grandchild
    assert tree is not None and tree >= 2 * n, tree
    assert proc.returncode == 0


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_server_process_records_the_servers_own_peak() -> None:
    """online.server_process(peak=...) reads the server's VmHWM just before it stops it: a /health server
    that holds N MiB reports at least N, as its extra's peak_rss_mib."""
    from benchmarks.peers.memory import ServerPeak
    from benchmarks.peers.online import free_port, server_process

    n = 96
    server = (f"import http.server, sys\nbuf = b'\\x01' * ({n} << 20)\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n        self.send_response(200)\n        self.end_headers()\n"
              "    def log_message(self, *args):\n        pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    port = free_port()
    peak = ServerPeak()
    with server_process([sys.executable, "-c", server, str(port)], f"http://127.0.0.1:{port}", timeout_s=60, peak=peak):
        pass
    extra = peak.extra()
    assert extra["peak_rss_source"] == "VmHWM"
    assert n <= extra["peak_rss_mib"] < n + 100, extra
