"""Where one captured K-head pass's time goes on a GPU (fp16, 128 x 32 and 512 x 32; bench_gpu.py's
random layer-mix heads, k=64, every state).

Per K (the arguments; default 1, 4, 16, 64): `ModelRunner.logits` per call (inputs copied in, the graph replayed, logits copied
out), the thread CPU time of one call started on an idle GPU, and the captured graph's replay alone,
each against the backbone's own graph (bench_gpu.py's `backbone_graph`). At every K above 1 also torch.profiler
tables: the graph path's host calls and kernels, and the eager pass's kernels (a graph's replay hides
which kernel is which). Prints only; on a lent GPU:

    python3 bench/profile_gpu_pass.py | tee $OUT/profile.log
    python3 bench/profile_gpu_pass.py 16 64   # only these K
"""
import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import backbone_graph, build_modules, sample_rows, seconds_per_call, shape_runner, with_precision  # noqa: E402

from modules_store import ModuleStore  # noqa: E402
from server.backbone import Backbone  # noqa: E402
from server.timings import Timings  # noqa: E402


def main() -> None:
    precision = "fp16"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ks", nargs="*", type=int, default=[1, 4, 16, 64], metavar="K",
                        help="head counts to profile (default 1 4 16 64)")
    ks = parser.parse_args().ks
    bb = with_precision(Backbone.load(None, device="cuda"), precision)
    heads = build_modules(ModuleStore(Path(tempfile.mkdtemp()) / precision), bb, max(ks))
    names = sorted(heads)
    for size, tokens in ((128, 32), (512, 32)):
        rows = sample_rows(bb, size, tokens)
        runner = shape_runner(bb, "cuda", precision, size, tokens, True)
        prepared = runner.prepare(rows, {names[0]: heads[names[0]]}).passes[0]
        batch, bucket = prepared.batch, prepared.bucket
        with torch.inference_mode(), runner.precision():
            t_backbone = seconds_per_call(backbone_graph(bb, copy.copy(batch).to("cuda"), "cuda"), "cuda", 50)
        print(f"{size}x{tokens} backbone graph {t_backbone * 1e3:.3f} ms")
        for k in ks:
            modules = {n: heads[n] for n in names[:k]}

            def call():
                return runner.logits(batch, bucket, modules, Timings())

            t = seconds_per_call(call, "cuda", 50)
            cpu = []
            for _ in range(30):  # the call ends with the logits' copy to the host, so it waits for the pass
                torch.cuda.synchronize()
                c0 = time.thread_time()
                call()
                cpu.append(time.thread_time() - c0)
            replay = seconds_per_call(runner.graphs.find(modules, bucket).graph.replay, "cuda", 50)
            print(f"  K={k}: logits {t * 1e3:.3f} ms (x{t_backbone / t:.2f}); thread CPU per call "
                  f"{1e3 * sorted(cpu)[15]:.3f} ms; replay alone {replay * 1e3:.3f} ms (x{t_backbone / replay:.2f})")
            if k > 1:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        call()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
                eager = shape_runner(bb, "cuda", precision, size, tokens, False)
                passed = eager.prepare(rows, modules).passes[0]
                for _ in range(3):
                    eager.logits(passed.batch, passed.bucket, modules, Timings())
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        eager.logits(passed.batch, passed.bucket, modules, Timings())
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        runner.forget_plans()


if __name__ == "__main__":
    main()
