"""Run GGUF files in llama.cpp (through llama-cpp-python) for ``interop/check.py``.

Runs in the interop virtual environment (llama-cpp-python and numpy only, no plugintrain):
``python llama_cpp_runner.py REQUEST.json OUT_DIR``. For each job of the request it loads
the file with llama.cpp's own loader (an f32 KV cache, one thread per core), tokenizes
each text as llama.cpp does (``add_special``: BOS where the file's vocabulary says so),
evaluates the given ids and saves every position's logits, and, where asked, decodes
greedily. Writes ``OUT_DIR/result.json`` and one ``.npy`` of logits per job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

GGML_TYPE_F32 = 0


def run(job: dict, out: Path, index: int) -> dict:
    llm = llama_cpp.Llama(
        model_path=job["gguf"],
        n_ctx=job.get("n_ctx", 128),
        logits_all=True,
        verbose=False,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        n_threads=2,
        seed=0,
    )
    result = {
        "gguf": job["gguf"],
        "tokens": [
            llm.tokenize(t.encode(), add_bos=True, special=False) for t in job.get("texts", [])
        ],
    }
    if job.get("ids"):
        llm.reset()
        llm.eval(job["ids"])
        logits = np.array(llm.scores[: len(job["ids"])], dtype=np.float32)
        np.save(out / f"logits_{index}.npy", logits)
        result["logits"] = f"logits_{index}.npy"
    if job.get("greedy"):
        llm.reset()
        produced = []
        llm.eval(job["greedy"]["ids"])
        for _ in range(job["greedy"]["n"]):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            produced.append(nxt)
            if nxt in job["greedy"].get("stop", []):
                break
            llm.eval([nxt])
        result["greedy"] = produced
    result["add_bos"] = (
        bool(llm._model.add_bos_token()) if hasattr(llm._model, "add_bos_token") else None
    )
    return result


def main() -> None:
    request, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    results = [run(job, out, i) for i, job in enumerate(request["jobs"])]
    (out / "result.json").write_text(
        json.dumps({"llama_cpp": llama_cpp.__version__, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
