"""fsdp-plan's model: the GPT presets (and T5-11B's shape) it plans, and a model's parameters and
FLOPs per unit, whole and as one TP rank holds them (apps/plan/fsdp_plan.py is the tool)."""

import math

# {name: (vocab, seq, layers, heads, d_model, d_ff)}: the GPT presets of models/gpt.cpp (d_ff = 4 d),
# and T5-11B's shape (24 + 24 layers, d_model 1024, d_ff 65536, 128 heads of 128) as a stack of
# 48 equal layers for the planner (its cross-attention adds a quarter to the decoder's layers).
MODELS = {
    "tiny": (256, 32, 2, 2, 32, 128),
    "small": (256, 64, 2, 4, 64, 256),
    "default": (256, 128, 4, 4, 256, 1024),
    "medium": (256, 256, 8, 8, 512, 2048),
    "1b": (50000, 2048, 24, 16, 1792, 7168),
    "175b": (50000, 2048, 96, 96, 12288, 49152),
    "t5-11b": (32128, 512, 48, 128, 1024, 65536),
    # A GPT of Llama 3 70B's width, depth, heads and vocabulary, with a GPT MLP (d_ff = 4 d, two
    # matrices; Llama's SwiGLU has three of 28672): 65.5 B parameters, for issue 27's comparison
    # with torchtitan's Llama 3.1 70B at FSDP 32 x TP 8.
    "70b": (128256, 8192, 80, 64, 8192, 32768),
}


class Model:
    def __init__(self, name, vocab, seq, layers, heads, d, d_ff, t5=False, tp=1):
        self.name, self.vocab, self.seq, self.layers, self.heads, self.d, self.d_ff = name, vocab, seq, layers, heads, d, d_ff
        self.tp = tp
        extra = 0.25 if t5 else 0.0  # T5's decoder cross-attention, averaged over its 48 layers
        self.block_params = int((4 * d * d * (1 + extra)) + 2 * d * d_ff + 9 * d + d_ff)
        self.root_params = vocab * d + seq * d + 2 * d
        # Forward FLOPs per token: 2 per weight, plus attention's two T x d products per layer.
        self.block_flops_per_token = 2 * self.block_params + 4 * seq * d
        self.head_flops_per_token = 2 * vocab * d
        # One TP rank's parts (models::gpt_tensor_parallel_plan): split weights and the column-parallel
        # biases (q/k/v 3 d, fc d_ff) / tp; LayerNorms (4 d) and row-parallel biases (2 d) whole.
        split = int(4 * d * d * (1 + extra)) + 2 * d * d_ff + 3 * d + d_ff
        self.block_params_local = split // tp + (self.block_params - split)
        self.root_params_local = vocab * d // tp + seq * d + 2 * d

    def total_params(self):
        return self.root_params + self.layers * self.block_params


def padded(n, F):
    return int(math.ceil(n / F) * F)
