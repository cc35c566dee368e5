"""The model runner (`model_runner.py`): how a batch of encoded rows becomes passes on the device, and
answers.

Layers call downwards only: runtime -> runner -> engine -> plan, in the manner of vLLM's engine ->
model runner -> graphs. The runtime hands the runner a batch; the runner decides the passes it needs
and how each runs, asks the engine for the plan once per pass and runs it (eager, or a captured
graph of it), and turns the logits into answers (server/answers.py, the one place that decodes). The
engine knows how one pass of a plan runs and nothing of shapes, graphs or answers.

- **Batch shapes** (`shapes.py`, `BatchShapes`, the one place where a CPU and a GPU differ). On a
  CPU compute scales with padded tokens, so rows (sorted by length) are cut into length runs, one
  pass each (`length_runs`). On a GPU a small pass costs its kernel launches, not its padding, so a
  batch is one pass with its rows padded up to a bucket length and the batch up to a bucket size,
  filler rows added (each sees one token; their outputs are dropped). Both lists of bucket sizes
  come from the settings, bounded by `max_batch_size` and the backbone's token limit; `reachable`
  lists every bucket a pass can land in (the ones captured at start). `bucket_runs` (opt-in) cuts a
  GPU batch into runs of rows, each padded to its own bucket, where the captured passes' times,
  measured at capture, say the runs cost less than the one pass (a batch of short rows and one long
  one).
- **Graphs** (`graphs.py`, `GraphCache`, `capture_cuda_graph`). On a cuda device the whole pass of a
  plan (backbone stream, every native head and group) at one bucket shape is captured once as a CUDA
  graph and replayed: inputs are copied into the graph's static input tensors, the replay writes
  every logit of the pass into one static output. Graphs are captured only between batches, never on
  a request's path: at start and after every module load, unload and reload (`warm_up`, on the
  compute thread), for the task sets requests that name no tasks run (single texts; text pairs:
  `served_task_sets`) at every reachable bucket. A request for a subset of a captured set replays
  the smallest captured superset and drops the other tasks' outputs; anything else runs eager. A
  plan with foreign modules replays the graph of its native part; its foreign tasks (a bridge
  tokenizes for its target inside the pass) run eager on the unpadded rows. Graphs belong to their
  plan (the cache holds it, so its heads stay alive while a graph may read them) and all of them
  share one memory pool, which is only ever dropped whole (`forget_plans`, then a fresh pool): no
  graph's blocks are freed while another may still replay over them. Capture stops at
  `graph_memory_mb`, counted from the pool's own segments. Capture runs in thread-local capture mode
  (the tokenizer threads may touch CUDA meanwhile), on the device's own stream, and the thread's
  stream is restored whatever the capture does (`capture_on`).
- **Host and device** (`model_runner.py`, `ModelRunner`; `staging.py`): batches are collated on the
  host (`prepare`, which the batcher runs on a tokenizer thread while the device runs the previous
  batch) and, on cuda, copied into page-locked staging buffers made at warm-up (`StagingBuffers`:
  two sets per bucket, one per batch in flight); copies to the device are non-blocking; all logits
  of a pass come back in one device-to-host copy (`pack_logits`) into page-locked memory from
  torch's host cache, queued behind the replay; nothing in the pass reads a device value on the host
  (per-token classes, casing and segment, are made at collate time). The same tokenizer thread then
  launches a batch's captured pass (`launch`: copy in, replay, copy out, an event), so the device
  holds the next pass while the compute thread waits for the last (sleeping on the event) and turns
  its logits into answers; graphs are replayed, captured and dropped under one lock, since each
  graph's input and output tensors are static.
- **Out of memory is an answer** (`failures.py`): a pass that does not fit (torch.OutOfMemoryError,
  or the CPU allocator's error) is split in halves and retried down to one row, after the failed
  pass is gone (only its error's text is kept: the exception's traceback would keep its states
  alive); a row that does not fit alone is refused with 503 (`OutOfMemory`), and every other row is
  still answered.
- **A dead device is not an answer**: a sticky CUDA error (`is_device_failure`) leaves the context
  unusable; the runtime then stops being ready and the process exits (server/runtime.py).
- **A failing head fails its own task**: a pass that raises otherwise runs again task by task; the
  task whose head fails is answered 500 (`HeadFailed`) for its rows, every other task as usual.
- **Precision** (`precision.py`): heads run under autocast in `head_precision` (`heads_autocast`;
  auto: the backbone's 16-bit precision; int8, CPU only and opt-in: the layer-mix projections as
  int8 products), with autocast's cast cache off, since a captured pass must not keep casts.
"""
