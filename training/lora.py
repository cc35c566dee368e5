"""LoRA for training MTB blocks, via peft; the served artifact keeps only the factors (our format)."""
from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model

from server.heads.lora_mtb import LoraMTBHead
from server.heads.lora_mtb.model import OWN_LAYERS
from server.heads.lora_mtb.layer import factor_names
from training.data.files import UsageError

ADAPTER = "default"


def block_linears(block: torch.nn.Module) -> list[str]:
    return [name for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)]


def names(target: str, linear: str) -> bool:
    """Whether `target` names `linear` as peft reads target_modules: its whole name, or its last parts."""
    return linear == target or linear.endswith("." + target)


class TrainableLoraMTB(LoraMTBHead):
    """A LoRA-MTB head with peft's unmerged LoRA layers inside its blocks, for training."""

    @classmethod
    def from_backbone(cls, backbone, task_type, labels, num_blocks=1, source_layer=None, rank=8,
                      lora_alpha=16.0, targets=None, **options) -> "TrainableLoraMTB":
        # default: every linear layer of the copied block, whatever the architecture names them
        # (BERT: query/key/value/attention output/intermediate/output; Llama: q/k/v/o, gate/up/down)
        linears = block_linears(backbone.adapter.layers[-1])
        unknown = [t for t in targets or () if not any(names(t, n) for n in linears)]
        if unknown:
            raise UsageError(f"--targets {','.join(unknown)}: not a linear layer of {backbone.name}'s blocks; they are "
                             f"{', '.join(linears)} (a name, or its last parts: {linears[0].rsplit('.', 1)[-1]})")
        # each as the full name of every linear it names (the artifact stores its factors by full name)
        targets = [n for n in linears if any(names(t, n) for t in targets)] if targets else linears
        extra = {"rank": rank, "lora_alpha": lora_alpha, "targets": targets}
        head = super().from_backbone(backbone, task_type, labels, num_blocks, source_layer, **extra, **options)
        lora = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=head.config.targets, lora_dropout=0.0,
                          bias="none")
        for block in head.blocks:
            for param in block.parameters():
                param.requires_grad_(False)  # the copied block stays frozen; only factors train
            inject_adapter_in_model(lora, block, adapter_name=ADAPTER)
        return head

    def artifact_weights(self) -> dict[str, torch.Tensor]:
        weights = {k: v for k, v in self.state_dict().items() if k.startswith(OWN_LAYERS)}
        for index, block in enumerate(self.blocks):
            for target in self.config.targets:
                layer = block.get_submodule(target)
                a_name, b_name = factor_names(index, target)
                weights[a_name] = layer.lora_A[ADAPTER].weight.detach().clone()
                weights[b_name] = layer.lora_B[ADAPTER].weight.detach().clone()
        return weights
