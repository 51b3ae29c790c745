"""eval-smoke: lm-evaluation-harness on two independent backends of the same weights, one number.

    .venv-eval/bin/python -m benchmarks.eval.smoke            (what `make eval-smoke` runs)

1. `octavo serve` (the project's venv) on the embedded SmolLM2-135M-Instruct GGUF, then lm-eval's
   `--model local-completions` against it: loglikelihoods through /v1/completions echo + logprobs, the
   tokenizer through the server's /tokenizer_info and /tokenize (lm-eval's "remote" tokenizer).
2. lm-eval's own `--model hf` on the same GGUF file (transformers dequantizes it; its own tokenizer).
3. Per item of the multiple-choice task: both backends' loglikelihood of every choice, the choice each picks;
   the accuracies must be equal, and where an item's pick differs both backends must see a near tie (the two
   picks' loglikelihoods within --tie of each other). The generate_until task's outputs are compared too.

Runs with lm-eval's venv (benchmarks/eval/requirements.txt); nothing is downloaded (HF_HUB_OFFLINE=1, the tasks'
data are JSON files in benchmarks/eval/tasks/). Writes results.json and summary.md under --out; exit status 1
when the accuracies differ or a differing item is not a near tie.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "benchmarks" / "eval" / "tasks"
MC, GEN = "octavo_smoke_mc", "octavo_smoke_gen"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--octavo-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="the python of the venv octavo is installed in (default: .venv/bin/python)")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the demo's SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=str(ROOT / "build" / "eval-smoke"), help="results folder")
    ap.add_argument("--tie", type=float, default=1e-3, help="a differing item must be a tie within this (nats)")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    ap.add_argument("--num-concurrent", type=int, default=4, help="lm-eval's concurrent requests to octavo")
    ap.add_argument("--skip-hf", action="store_true", help="reuse --out's previous hf run")
    ap.add_argument("--report-only", action="store_true", help="compare --out's previous runs, run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **OFFLINE}
    gguf = Path(args.gguf or _default_gguf(args.octavo_python))
    tasks = f"{MC},{GEN}"
    common = ["--tasks", tasks, "--include_path", str(TASKS), "--log_samples", "--seed", "1234"]
    if args.limit:
        common += ["--limit", str(args.limit)]

    if args.report_only:
        return _report(out, args.tie, gguf, json.loads((out / "results.json").read_text())["seconds"])
    t0 = time.monotonic()
    with _octavo_server(args.octavo_python, gguf, out / "octavo-serve.log", env) as url:
        _lm_eval(["--model", "local-completions", "--model_args",
                  f"model=smollm2,base_url={url}/v1/completions,num_concurrent={args.num_concurrent},"
                  "max_retries=1,tokenizer_backend=auto,timeout=600",
                  "--output_path", str(out / "octavo"), *common], env, out / "lm-eval-octavo.log")
    t_octavo = time.monotonic() - t0
    t0 = time.monotonic()
    if not args.skip_hf:
        _lm_eval(["--model", "hf", "--model_args", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
                  "--device", "cpu", "--batch_size", "8", "--output_path", str(out / "hf"), *common],
                 env, out / "lm-eval-hf.log")
    t_hf = time.monotonic() - t0
    return _report(out, args.tie, gguf, {"octavo": round(t_octavo, 1), "hf": round(t_hf, 1)})


def _report(out: Path, tie: float, gguf: Path, seconds: dict[str, float]) -> int:
    report = compare(out / "octavo", out / "hf", tie)
    report["seconds"] = seconds
    report["gguf"] = gguf.name
    (out / "results.json").write_text(json.dumps(report, indent=1))
    md = summary_markdown(report)
    (out / "summary.md").write_text(md)
    print(md)
    return 0 if report["ok"] else 1


def _default_gguf(python: str) -> str:
    return subprocess.run([python, "-c", "from octavo.export.embedded import default_model_path; "
                           "print(default_model_path())"], check=True, capture_output=True, text=True).stdout.strip()


class _octavo_server:  # noqa: N801 - used as a context manager
    """`octavo serve GGUF` on a free loopback port; yields its base URL once /health answers 200."""

    def __init__(self, python: str, gguf: Path, log: Path, env: dict[str, str]) -> None:
        self.cmd = [python, "-m", "octavo", "serve", str(gguf), "--port", "0", "--served-model-name", "smollm2",
                    "--max-num-seqs", "16"]
        self.log, self.env = log, {**env, "PYTHONUNBUFFERED": "1"}

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, cwd=ROOT)
        self.lines: list[str] = []
        url = None
        while url is None:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"octavo serve exited ({self.proc.wait()}):\n{''.join(self.lines)}")
            self.lines.append(line)
            m = re.search(r"listening on (http://[\d.]+:\d+)", line)
            url = m.group(1) if m else None
        self._pump()
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"octavo serve did not become ready; see {self.log}")
            time.sleep(0.2)
        print(f"octavo serve ready at {url}", flush=True)
        return url

    def _pump(self) -> None:
        import threading

        def copy() -> None:
            with self.log.open("w") as f:
                f.writelines(self.lines)
                for line in self.proc.stdout:
                    f.write(line)
                    f.flush()

        self.thread = threading.Thread(target=copy, daemon=True)
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.thread.join(10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _lm_eval(argv: list[str], env: dict[str, str], log: Path) -> None:
    cmd = [sys.executable, "-m", "lm_eval", *argv]
    print("$ " + " ".join(cmd), flush=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        raise SystemExit(f"lm_eval failed ({rc}); see {log}:\n" + "".join(log.read_text().splitlines(True)[-30:]))


# -------------------------------------------------------------------------------------------------
# comparison


def _samples(folder: Path, task: str) -> dict[int, dict]:
    files = sorted(folder.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no lm-eval samples for {task} under {folder}")
    return {s["doc_id"]: s for s in map(json.loads, files[-1].read_text().splitlines())}


def _results(folder: Path) -> dict:
    files = sorted(folder.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(files[-1].read_text())["results"]


def compare(octavo_dir: Path, hf_dir: Path, tie: float) -> dict:
    """Per item of the multiple-choice task: both backends' loglikelihoods and picks; and the generations."""
    a, b = _samples(octavo_dir, MC), _samples(hf_dir, MC)
    items, max_diff = [], 0.0
    for doc_id in sorted(a):
        lla = [float(r[0]) for r in a[doc_id]["filtered_resps"]]
        llb = [float(r[0]) for r in b[doc_id]["filtered_resps"]]
        pa, pb = max(range(len(lla)), key=lla.__getitem__), max(range(len(llb)), key=llb.__getitem__)
        diff = max(abs(x - y) for x, y in zip(lla, llb))
        max_diff = max(max_diff, diff)
        item = {"doc_id": doc_id, "answer": a[doc_id]["doc"]["answer"], "pick_octavo": pa, "pick_hf": pb,
                "acc_octavo": a[doc_id]["acc"], "acc_hf": b[doc_id]["acc"], "max_abs_diff": diff,
                "ll_octavo": lla, "ll_hf": llb}
        if pa != pb:
            item["margin_octavo"] = abs(lla[pa] - lla[pb])
            item["margin_hf"] = abs(llb[pa] - llb[pb])
            item["near_tie"] = item["margin_octavo"] <= tie and item["margin_hf"] <= tie
        items.append(item)
    def gap(ll: list[float]) -> float:
        top = sorted(ll, reverse=True)
        return top[0] - top[1]

    closest = min(items, key=lambda i: gap(i["ll_octavo"]))
    ra, rb = _results(octavo_dir), _results(hf_dir)
    acc_a, acc_b = ra[MC]["acc,none"], rb[MC]["acc,none"]
    differing = [i for i in items if i["pick_octavo"] != i["pick_hf"]]
    ga, gb = _samples(octavo_dir, GEN), _samples(hf_dir, GEN)
    gens = [{"doc_id": d, "octavo": ga[d]["resps"][0][0], "hf": gb[d]["resps"][0][0],
             "exact_match_octavo": ga[d]["exact_match"], "exact_match_hf": gb[d]["exact_match"]} for d in sorted(ga)]
    return {
        "ok": acc_a == acc_b and all(i["near_tie"] for i in differing),
        "mc": {"items": len(items), "acc_octavo": acc_a, "acc_hf": acc_b, "acc_norm_octavo": ra[MC]["acc_norm,none"],
               "acc_norm_hf": rb[MC]["acc_norm,none"], "max_abs_loglikelihood_diff": max_diff,
               "differing_items": [i["doc_id"] for i in differing], "tie": tie,
               "closest": {"doc_id": closest["doc_id"], "gap_octavo": gap(closest["ll_octavo"]),
                           "gap_hf": gap(closest["ll_hf"])}, "per_item": items},
        "gen": {"items": len(gens), "exact_match_octavo": ra[GEN]["exact_match,strip"],
                "exact_match_hf": rb[GEN]["exact_match,strip"],
                "identical_generations": sum(g["octavo"] == g["hf"] for g in gens), "per_item": gens},
    }


def summary_markdown(r: dict) -> str:
    mc, gen = r["mc"], r["gen"]
    lines = [
        f"eval-smoke on {r['gguf']} ({'OK' if r['ok'] else 'FAILED'}; octavo {r['seconds']['octavo']} s, "
        f"hf {r['seconds']['hf']} s)", "",
        "| task | metric | octavo serve (local-completions) | lm-eval hf (transformers) |",
        "| --- | --- | --- | --- |",
        f"| {MC} ({mc['items']} items) | acc | {mc['acc_octavo']:.4f} | {mc['acc_hf']:.4f} |",
        f"| {MC} | acc_norm | {mc['acc_norm_octavo']:.4f} | {mc['acc_norm_hf']:.4f} |",
        f"| {GEN} ({gen['items']} items) | exact_match | {gen['exact_match_octavo']:.4f} | {gen['exact_match_hf']:.4f} |",
        "",
        f"- largest |loglikelihood difference| over all {mc['items']} x choices: {mc['max_abs_loglikelihood_diff']:.2e}",
        f"- closest item (smallest gap between its two likeliest choices, octavo / hf): doc {mc['closest']['doc_id']}, "
        f"{mc['closest']['gap_octavo']:.2e} / {mc['closest']['gap_hf']:.2e}",
        f"- items whose pick differs: {len(mc['differing_items'])}"
        + "".join(f"\n  - doc {i['doc_id']}: octavo picks {i['pick_octavo']}, hf picks {i['pick_hf']}; margins "
                  f"{i['margin_octavo']:.2e} / {i['margin_hf']:.2e} ({'near tie' if i['near_tie'] else 'NOT a tie'})"
                  for i in mc["per_item"] if i["pick_octavo"] != i["pick_hf"]),
        f"- identical generations: {gen['identical_generations']} of {gen['items']}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
