"""K random heads of one kind (seeded), saved to a module store and loaded back with `load_module`,
the path the server uses: what the sharing benchmarks serve. bench_sharing.py builds its heads here;
bench_gpu.py (or any other benchmark) can import the same function:

    from bench.random_heads import build_modules
    modules = build_modules(store, backbone, 16)                     # layer-mix, every state, k=64
    modules = build_modules(store, backbone, 16, kind="mtb")         # one perturbed copy of the last block
    modules = build_modules(store, backbone, 16, kind="lora-mtb")    # rank-8 factors, merged at load

Head i is a sequence classifier (2 SST-2 labels) for even i and a token classifier (9 CoNLL-2003 BIO
labels) for odd i. Layer-mix: one self-attention layer + masked mean + linear, or one pre-LN encoder
layer (FFN 256) + linear, over a mix of `layers` (default every state 0..L) at width `project_dim`.
MTB / LoRA-MTB: mean pooling + linear or a linear per token, on a copy of the backbone's last block.
"""
from __future__ import annotations

import torch

from bench.harness import CONLL_LABELS, SST2_LABELS
KINDS = ("layermix", "mtb", "lora-mtb")


def task_type_and_labels(i: int) -> tuple[str, list[str]]:
    return ("sequence_classification", SST2_LABELS) if i % 2 == 0 else ("token_classification", CONLL_LABELS)


def task_name(i: int, tag: str = "") -> str:
    return f"{'seq' if i % 2 == 0 else 'tok'}{i}{tag}"


def make_head(i: int, backbone, layers: list[int] | None = None, project_dim: int = 64, seed: int = 0,
              kind: str = "layermix"):
    """Random head number i of `kind` for `backbone` (eval mode)."""
    torch.manual_seed(seed * 1000 + i)
    task_type, labels = task_type_and_labels(i)
    if kind == "layermix":
        from server.heads.layermix import LayerMixConfig, LayerMixHead

        layers = list(range(backbone.num_layers + 1)) if layers is None else layers
        config = LayerMixConfig(task_type=task_type, num_labels=len(labels), hidden_size=backbone.hidden_size,
                                layers=layers, project_dim=project_dim)
        return LayerMixHead(config, labels).eval()
    if kind == "mtb":
        from server.heads.mtb import MTBHead

        head = MTBHead.from_backbone(backbone, task_type, labels)
        trained = head.parameters()
    elif kind == "lora-mtb":
        from training.lora import TrainableLoraMTB

        head = TrainableLoraMTB.from_backbone(backbone, task_type, labels, rank=8, lora_alpha=16.0)
        trained = (p for name, p in head.named_parameters() if "lora_" in name or "task_layer" in name)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    with torch.no_grad():  # as if trained: every head's weights differ (LoRA's B factor starts at zero)
        for p in trained:
            p.add_(torch.randn_like(p) * 0.02)
    return head.eval()


def build_modules(store, backbone, count: int, layers=None, project_dim: int = 64, seed: int = 0, tag: str = "",
                  kind: str = "layermix") -> dict:
    """Save `count` random heads of `kind` to `store` (unless already there) and load them back for
    `backbone`: task name -> LoadedModule. Layer-mix `layers`: the states every head reads, or a
    function of the head index giving them (default every state)."""
    from server.modules import load_module, save_module

    modules = {}
    for i in range(count):
        name = task_name(i, tag)
        if name not in store.tasks():
            head_layers = layers(i) if callable(layers) else layers
            head = make_head(i, backbone, head_layers, project_dim, seed, kind)
            save_module(store, name, "1", head, backbone, description=f"bench: random {kind} head")
        modules[name] = load_module(store, name, None, backbone, str(backbone.device))
    return modules
