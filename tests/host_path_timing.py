"""Microseconds of host CPU per one-text request for tokenizing and for decoding (issue 37), as a worker
does them: `encode([text], whole=True)` (what server/windows.py reads a text with), and the request's
three answers (sentiment, ner, acceptability on all-MiniLM-L6-v2) from the logits the engine sends
back: the rows collated and `decode_rows` per task (as server/workers/remote_runtime.py does), and where the code
has it, `decode_rows` straight from the rows. Real SST-2 and CoNLL-2003 validation sentences, 20 of
each, one request each; best of 7 rounds. Not a test (no timing is asserted); it runs on whichever
tmod is on PYTHONPATH, so before and after are the same command:

    for tree in /work/main /work/wt-hostcompute /work/main /work/wt-hostcompute; do
        PYTHONPATH=$tree TMOD_DATA_DIR=/work/shared/data HF_HUB_OFFLINE=1 \\
            /work/main/.venv/bin/python tests/host_path_timing.py; done
"""
from __future__ import annotations

import csv
import inspect
import time
import timeit

import torch

TASKS = ("sentiment", "ner", "acceptability")


def main(texts_per_source: int = 20, rounds: int = 7, number: int = 20) -> dict[str, float]:
    import server
    from modules_store import DEFAULT_STORE, ModuleStore
    from server.backbone import Backbone
    from server.engine import Engine
    from server.heads import decode as decode_module
    from server.modules import load_module
    from training.data.conll import read_conll
    from training.data.files import default_data_dir

    torch.set_num_threads(1)  # a worker's setting (server/workers/remote_runtime.py, one_host_thread)
    backbone = Backbone.load()
    encoder = backbone.text
    data = default_data_dir()
    with open(data / "sst2" / "validation.tsv", encoding="utf-8", newline="") as f:
        sst2 = [row[0] for row in list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]]
    conll = read_conll(data / "conll2003" / "validation.txt").texts()
    texts = [t for pair in zip(sst2[:texts_per_source], conll[:texts_per_source]) for t in pair]
    store = ModuleStore(DEFAULT_STORE)
    modules = {task: load_module(store, task, None, backbone) for task in TASKS}
    engine = Engine(backbone)
    requests = []
    for text in texts:  # each request's packed logits, as the engine sends them (float32, the rows' own tokens)
        rows = encoder.encode([text], whole=True)
        with torch.inference_mode():
            logits, _ = engine.run(encoder.collate(rows), modules)
        packed = {task: (out[0, :len(rows[0])] if out.dim() == 3 else out).float().numpy().copy()
                  for task, out in logits.items()}
        requests.append((rows, packed))
    decode_rows = decode_module.decode_rows
    heads = [(task, m.manifest.task_type, m.manifest.labels, m.manifest.decoding) for task, m in modules.items()]

    def tokenize():
        for text in texts:
            encoder.encode([text], whole=True)

    def decode_collated():
        for rows, packed in requests:
            batch = encoder.collate(rows, device="cpu")
            for task, task_type, labels, decoding in heads:
                decode_rows(task_type, labels, packed[task], batch, [None], decoding)

    def decode_from_rows():
        for rows, packed in requests:
            for task, task_type, labels, decoding in heads:
                decode_rows(task_type, labels, packed[task], rows, [None], decoding)

    cases = {"tokenize": tokenize, "decode (collate + decode_rows)": decode_collated}
    if "Tokens" in vars(decode_module):  # decode_rows takes the rows themselves (issue 37)
        cases["decode (decode_rows from the rows)"] = decode_from_rows
    out = {}
    for name, run in cases.items():
        run()
        best = min(timeit.repeat(run, timer=time.process_time, number=number, repeat=rounds))  # CPU time: the machine may be shared
        out[name] = best / number / len(texts) * 1e6
    where = inspect.getfile(server).rsplit("/server/", 1)[0]
    print(f"{where}: " + ", ".join(f"{name} {us:.1f} µs" for name, us in out.items()))
    return out


if __name__ == "__main__":
    main()
