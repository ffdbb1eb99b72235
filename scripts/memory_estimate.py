"""Learner memory per GPU for Qwen3-1.7B/4B/8B at the paper's lengths (DESIGN.md §7), as Markdown tables.

    python scripts/memory_estimate.py                                   # the three models, the paper's lengths
    python scripts/memory_estimate.py --models 1.7B --completion-tokens 2048 --fsdp 1 2
    python scripts/memory_estimate.py --learner-ranks 1 2 4 8 --strategy ddp fsdp2   # + per-rank table

What is counted (GiB = 2**30 bytes), for one micro-batch of ``sequences`` rows of ``prompt + completion`` tokens:

- Model states: master weights, their gradients (same dtype; manual optimisation keeps them through the step),
  and AdamW's two moments: 4 bytes each per parameter in fp32 (torch AdamW keeps them in the parameter dtype),
  or bitsandbytes' 8-bit blockwise states (1 byte each plus one fp32 absmax per block of 256; tensors under
  4,096 elements keep fp32 states).
- bf16 weight copies: Lightning's ``bf16-mixed`` runs ``torch.autocast`` with its weight cache off, so each
  linear casts its fp32 weight when it runs and the copy lives while autograd saves it. Under gradient
  checkpointing that is one decoder layer at a time, plus the LM head's copy during each chunk.
- Activations under gradient checkpointing: every decoder layer's input (the residual stream, which stays fp32
  under autocast with fp32 weights: the embedding output is fp32 and each residual add promotes), the final
  norm, then at the peak either one layer's recomputed activations or one LM-head chunk, whichever is larger
  (the head's backward runs before any layer's). Per-layer bytes are enumerated in
  :func:`layer_activation_bytes_per_token`; ``tests/test_memory_estimate.py`` checks them against the tensors
  autograd actually saves for a Qwen3 layer on CPU.
- LM-head chunk: ``sequences x chunk_positions x vocab`` logits at 12 bytes each (bf16 logits, their fp32 copy,
  the log-softmax and its gradient; measured 10-12 bytes per logit on CPU for a checkpointed chunk).
- FSDP over k GPUs (Lightning's FSDP with ``bf16-mixed``: bf16 all-gathered parameters, fp32 sharded masters):
  model states divided by k, plus the bf16 gather of two decoder layers (current and prefetched) and of the
  embedding and head; activations are those of bf16 compute, since the gathered weights are bf16.
- Per learner rank under ``--trainer.strategy`` (``--learner-ranks k``, :func:`per_rank`), for what lit_gmc
  ships: ``ddp`` keeps everything whole on every rank and adds DDP's all-reduce buckets, a second copy of the
  gradients (Lightning's ``DDPStrategy`` leaves ``gradient_as_bucket_view`` off); ``fsdp2``
  (``lit_gmc.strategies.FSDP2Strategy``: ``fully_shard`` per decoder layer plus a root unit of embedding, final
  norm and head, no ``MixedPrecisionPolicy``) divides weights, gradients and optimizer states by k exactly
  (dim-0 padding ignored) and divides nothing else: activations and the LM-head chunk are the single device's
  (autocast over gathered fp32 weights), plus the gathered fp32 weights of two decoder layers (current and
  prefetched) and of the root unit (FSDP2 keeps the root gathered from forward through backward), and the
  root's unsharded head gradient, reduce-scattered only when the backward ends.

- The behaviour recompute (``--data.engine.recompute_behavior_logprobs``, off by default;
  ``--recompute-behavior-logprobs`` here): a second full copy of the actor in the learner's parameter dtype on the
  engine owner's device (global rank 0), resident for the whole run; its forward-only scoring runs between updates,
  never beside the backward's peak.

Not counted: the CUDA context and allocator fragmentation (typically 1-3 GiB), gradient temporaries of the
layer being back-propagated, and the rollout engine (colocated vLLM takes ``gpu_memory_utilization`` of the GPU
while awake and frees its weights and KV cache while asleep).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Literal

GIB = 2**30
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 states for tensors smaller than this (min_8bit_size)
BNB_BLOCK = 256  # elements per quantisation block of bitsandbytes' blockwise 8-bit optimizer states
HEAD_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class Arch:
    """The shape of a Qwen3 causal LM (no attention bias, q/k RMSNorm over ``head_dim``, SwiGLU MLP)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 151_936
    tied: bool = True


# From the models' config.json on the Hub (Qwen/Qwen3-{1.7B,4B,8B}-Base).
QWEN3 = {
    "1.7B": Arch("Qwen3-1.7B", hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    "4B": Arch("Qwen3-4B", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728),
    "8B": Arch("Qwen3-8B", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, tied=False),
}


@dataclass(frozen=True)
class Setting:
    """How the learner holds and computes the model.

    Attributes:
        name: Row label.
        param_bytes: Bytes per master weight (and per gradient: gradients take the parameters' dtype).
        optimizer: ``adamw8bit`` (bitsandbytes) or ``adamw`` (torch, moments in the parameter dtype).
        residual_bytes: Bytes per element of the residual stream between layers.
        autocast: Whether weights are cast to bf16 per op (fp32 weights under ``bf16-mixed``).
    """

    name: str
    param_bytes: int
    optimizer: Literal["adamw8bit", "adamw"]
    residual_bytes: int
    autocast: bool


SETTINGS = (
    Setting("fp32 master + bf16-mixed + 8-bit AdamW (shipped)", 4, "adamw8bit", 4, True),
    Setting("fp32 master + bf16-mixed + fp32 AdamW", 4, "adamw", 4, True),
    Setting("pure bf16 + 8-bit AdamW (loses lr 1e-6 updates)", 2, "adamw8bit", 2, False),
)


@dataclass(frozen=True)
class Workload:
    """One micro-batch: ``sequences`` rows of ``prompt_tokens + completion_tokens``; the head runs in chunks."""

    prompt_tokens: int = 1024
    completion_tokens: int = 4096
    sequences: int = 8  # micro_batch_groups: 1 group of G = 8
    chunk_positions: int = 512  # logit_chunk_tokens

    @property
    def tokens(self) -> int:
        """Tokens through the backbone."""
        return self.sequences * (self.prompt_tokens + self.completion_tokens)


def layer_parameter_sizes(arch: Arch) -> list[int]:
    """Element counts of one decoder layer's tensors, in ``named_parameters()`` order."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    attention = [arch.hidden * q, arch.hidden * kv, arch.hidden * kv, q * arch.hidden, arch.head_dim, arch.head_dim]
    mlp = [arch.hidden * arch.intermediate] * 3
    return attention + mlp + [arch.hidden, arch.hidden]  # q, k, v, o, q_norm, k_norm; gate, up, down; 2 norms


def parameter_sizes(arch: Arch) -> list[int]:
    """Element counts of every parameter tensor, in the order ``Qwen3ForCausalLM.named_parameters()`` lists them."""
    embedding = arch.vocab * arch.hidden
    head = [] if arch.tied else [embedding]  # a tied head is the embedding, listed once
    return [embedding, *layer_parameter_sizes(arch) * arch.layers, arch.hidden, *head]


def param_count(arch: Arch) -> int:
    """Number of parameters."""
    return sum(parameter_sizes(arch))


def optimizer_bytes(sizes: list[int], setting: Setting) -> int:
    """AdamW's two moments for tensors of ``sizes`` elements."""
    if setting.optimizer == "adamw":
        return sum(2 * setting.param_bytes * n for n in sizes)
    return sum(8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK) for n in sizes)


def norm_bytes_per_token(width: int, input_bytes: int, input_kept: bool = False) -> int:
    """What Qwen3's RMSNorm adds to the saved tensors: its input upcast to fp32, and the normalised tensor in the
    input dtype. An fp32 input is saved as it is, which adds nothing when something else keeps it (``input_kept``,
    e.g. a layer's input, which its checkpoint holds)."""
    upcast = 0 if input_bytes == 4 and input_kept else 4
    return (upcast + input_bytes) * width


def layer_activation_bytes_per_token(arch: Arch, setting: Setting) -> int:
    """Bytes autograd saves per token in one decoder layer beyond its inputs (bf16 compute; SDPA with a padding mask).

    Attention: the input norm; the bf16 inputs of q/k/v (under autocast each linear casts its own copy of the
    fp32 norm output, otherwise they share one); the q/k norms (fp32 upcast + bf16 normalised); SDPA's q, its
    k/v repeated to every head (a padding mask rules out the grouped-query kernel), its output and fp32
    log-sum-exp; o_proj's input. MLP: the norm; gate/up inputs (one cast each under autocast); SiLU's input,
    both factors of the product and down_proj's input, all bf16.
    """
    h, i, r = arch.hidden, arch.intermediate, setting.residual_bytes
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    qkv_inputs, gate_up_inputs = (3 * 2 * h, 2 * 2 * h) if setting.autocast else (2 * h, 2 * h)
    sdpa = 2 * q + 2 * 2 * q + 2 * q + 4 * arch.heads  # q, repeated k and v, output; lse
    attention = norm_bytes_per_token(h, r, input_kept=True) + qkv_inputs + 6 * (q + kv) + sdpa + 2 * q
    mlp = norm_bytes_per_token(h, r) + gate_up_inputs + 4 * 2 * i
    return attention + mlp


def state_parts(arch: Arch, setting: Setting, shards: int = 1) -> dict[str, float]:
    """Master weights, gradients and optimizer states per GPU, in bytes, sharded ``shards`` ways."""
    sizes = parameter_sizes(arch)
    n = sum(sizes)
    return {
        "params": setting.param_bytes * n / shards,
        "grads": setting.param_bytes * n / shards,
        "optimizer": optimizer_bytes(sizes, setting) / shards,
    }


def checkpoint_bytes(arch: Arch, setting: Setting, work: Workload) -> int:
    """What lives through the whole backward: each layer's input, the final norm and its output (the head's
    input), the rotary tables, and the 4D boolean attention mask."""
    r, width = setting.residual_bytes, work.prompt_tokens + work.completion_tokens
    per_token = arch.layers * r * arch.hidden + norm_bytes_per_token(arch.hidden, r) + r * arch.hidden
    per_token += 2 * arch.head_dim * r  # cos and sin, in the hidden states' dtype
    return work.tokens * per_token + work.sequences * width * width


def activation_parts(arch: Arch, setting: Setting, work: Workload) -> dict[str, float]:
    """Activation memory, in bytes: ``checkpoints`` for the whole backward, then ``layer`` (one layer recomputed,
    with its bf16 weight copies) or ``head`` (one LM-head chunk, with the head's bf16 copy), never both at once."""
    layer = work.tokens * layer_activation_bytes_per_token(arch, setting)
    layer += 2 * sum(layer_parameter_sizes(arch)) if setting.autocast else 0
    head = work.sequences * min(work.chunk_positions, work.completion_tokens) * arch.vocab * HEAD_BYTES_PER_LOGIT
    head += 2 * arch.vocab * arch.hidden if setting.autocast else 0
    return {"checkpoints": checkpoint_bytes(arch, setting, work), "layer": layer, "head": head}


def recompute_copy_bytes(arch: Arch, setting: Setting) -> int:
    """The behaviour recompute's model copy: every parameter in the learner's dtype (``BehaviorRecompute``)."""
    return setting.param_bytes * param_count(arch)


def single_gpu(arch: Arch, setting: Setting, work: Workload, recompute: bool = False) -> dict[str, float]:
    """Every part of one GPU's peak, in GiB, plus ``resident`` (model states kept between steps) and ``peak``.

    ``recompute_copy`` is the behaviour recompute's model copy, counted in ``resident`` and ``peak`` only when
    ``recompute`` is on (``--data.engine.recompute_behavior_logprobs``).
    """
    states = state_parts(arch, setting)
    acts = activation_parts(arch, setting, work)
    copy = recompute_copy_bytes(arch, setting)
    parts = {**states, **acts, "recompute_copy": copy, "resident": sum(states.values()) + (copy if recompute else 0)}
    parts["peak"] = parts["resident"] + acts["checkpoints"] + max(acts["layer"], acts["head"])
    return {k: v / GIB for k, v in parts.items()}


def fsdp_per_gpu(arch: Arch, setting: Setting, work: Workload, shards: int) -> dict[str, float]:
    """One GPU's share under FSDP over ``shards`` GPUs with bf16 gathered weights, in GiB."""
    states = state_parts(arch, setting, shards)
    bf16 = replace(setting, residual_bytes=2, autocast=False)  # gathered weights are bf16: so is the compute
    acts = activation_parts(arch, bf16, work)
    gathered = 2 * (2 * sum(layer_parameter_sizes(arch)) + arch.vocab * arch.hidden * (1 if arch.tied else 2))
    resident = sum(states.values())
    peak = resident + gathered + acts["checkpoints"] + max(acts["layer"], acts["head"])
    return {"resident": resident / GIB, "gathered": gathered / GIB, "activations": (peak - resident - gathered) / GIB,
            "peak": peak / GIB}  # fmt: skip


def ddp_per_rank(arch: Arch, setting: Setting, work: Workload) -> dict[str, float]:
    """One rank's share under DDP, in GiB: the single device's parts (nothing is divided, whatever the number of
    ranks), plus ``buckets``, the all-reduce buckets, a full copy of the gradients when ``gradient_as_bucket_view``
    is off (torch's and Lightning's default)."""
    parts = single_gpu(arch, setting, work)
    buckets = parts["grads"]
    return {**parts, "buckets": buckets, "resident": parts["resident"] + buckets, "peak": parts["peak"] + buckets}


def root_unit_sizes(arch: Arch) -> int:
    """Elements in FSDP2's root unit (``GMCModule.configure_model``): embedding, final norm and untied head."""
    return arch.vocab * arch.hidden * (1 if arch.tied else 2) + arch.hidden


def fsdp2_per_rank(arch: Arch, setting: Setting, work: Workload, ranks: int) -> dict[str, float]:
    """One rank's share under ``lit_gmc.strategies.FSDP2Strategy`` over ``ranks`` learner ranks, in GiB.

    ``params``, ``grads`` and ``optimizer`` are the single device's divided by ``ranks``; ``checkpoints``,
    ``layer`` and ``head`` (activations, the LM-head chunk) are not divided; ``gathered`` is the unsharded
    weights in their own dtype (two decoder layers and the root unit) and ``unsharded_grads`` the root's head
    gradient, which lives until the root's reduce-scatter at the end of the backward.
    """
    states = state_parts(arch, setting, ranks)
    acts = activation_parts(arch, setting, work)
    gathered = setting.param_bytes * (2 * sum(layer_parameter_sizes(arch)) + root_unit_sizes(arch))
    unsharded_grads = setting.param_bytes * (arch.vocab * arch.hidden + arch.hidden)
    resident = sum(states.values())
    parts = {**states, **acts, "gathered": gathered, "unsharded_grads": unsharded_grads, "resident": resident}
    parts["peak"] = resident + gathered + unsharded_grads + acts["checkpoints"] + max(acts["layer"], acts["head"])
    return {k: v / GIB for k, v in parts.items()}


def per_rank(strategy: Literal["ddp", "fsdp2"], arch: Arch, setting: Setting, work: Workload, ranks: int
             ) -> dict[str, float]:  # fmt: skip
    """One learner rank's parts and ``peak``, in GiB, under ``--trainer.strategy`` over ``ranks`` ranks."""
    if strategy == "ddp":
        return ddp_per_rank(arch, setting, work)
    return fsdp2_per_rank(arch, setting, work, ranks)


def gb(value: float) -> str:
    """GiB with one decimal."""
    return f"{value:.1f}"


PARTS = ("params", "grads", "optimizer", "checkpoints", "layer", "head", "recompute_copy", "resident", "peak")


def settings_table(models: list[str], work: Workload, recompute: bool = False) -> str:
    """One row per model and setting: the parts of a single GPU's peak, in GiB (with the recompute's copy if on)."""
    lines = [
        "| model (params) | setting | weights | grads | optimizer | layer-boundary checkpoints | one layer recomputed "
        "(+ its bf16 weights) | LM-head chunk | behaviour recompute copy (if on) | resident between steps | peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in models:
        arch = QWEN3[key]
        label = f"{arch.name} ({param_count(arch) / 1e9:.2f}B)"
        for setting in SETTINGS:
            p = single_gpu(arch, setting, work, recompute)
            cells = [p[k] for k in PARTS]
            lines.append(f"| {label} | {setting.name} | " + " | ".join(gb(c) for c in cells) + " |")
    return "\n".join(lines)


def fsdp_table(models: list[str], work: Workload, shard_counts: list[int]) -> str:
    """The shipped setting's per-GPU peak (and resident states) when the learner is sharded over k GPUs."""
    header = " | ".join(f"k = {k}" for k in shard_counts)
    lines = [f"| model | {header} |", "|---|" + "---:|" * len(shard_counts)]
    for key in models:
        arch = QWEN3[key]
        cells = []
        for k in shard_counts:
            p = single_gpu(arch, SETTINGS[0], work) if k == 1 else fsdp_per_gpu(arch, SETTINGS[0], work, k)
            cells.append(f"{gb(p['peak'])} ({gb(p['resident'])})")
        lines.append(f"| {arch.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_rank_table(models: list[str], work: Workload, ranks: list[int], strategies: list[str]) -> str:
    """The shipped setting's peak per learner rank (and its resident states) under each strategy over k ranks."""
    header = " | ".join(f"k = {k}" for k in ranks)
    lines = [f"| model | strategy | {header} |", "|---|---|" + "---:|" * len(ranks)]
    for key in models:
        arch = QWEN3[key]
        for strategy in strategies:
            parts = [per_rank(strategy, arch, SETTINGS[0], work, k) for k in ranks]  # type: ignore[arg-type]
            cells = " | ".join(f"{gb(p['peak'])} ({gb(p['resident'])})" for p in parts)
            lines.append(f"| {arch.name} | {strategy} | {cells} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(QWEN3), choices=list(QWEN3))
    parser.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    parser.add_argument("--completion-tokens", type=int, default=Workload.completion_tokens)
    parser.add_argument("--sequences", type=int, default=Workload.sequences, help="rows per micro-batch")
    parser.add_argument("--chunk-positions", type=int, default=Workload.chunk_positions, help="logit_chunk_tokens")
    parser.add_argument("--fsdp", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="GPU counts for the FSDP table (none: no table)")  # fmt: skip
    parser.add_argument("--learner-ranks", type=int, nargs="*", default=[],
                        help="learner ranks k for the per-rank table of --strategy (none: no table)")  # fmt: skip
    parser.add_argument("--strategy", nargs="+", choices=["ddp", "fsdp2"], default=["ddp", "fsdp2"],
                        help="--trainer.strategy values in the per-rank table")  # fmt: skip
    parser.add_argument("--recompute-behavior-logprobs", action="store_true",
                        help="count the recompute's model copy "
                             "(--data.engine.recompute_behavior_logprobs)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Workload(args.prompt_tokens, args.completion_tokens, args.sequences, args.chunk_positions)
    print(f"Learner memory per GPU, GiB: micro-batch of {work.sequences} sequences x ({work.prompt_tokens} prompt + "
          f"{work.completion_tokens} completion) tokens, gradient checkpointing, LM head in chunks of "
          f"{work.chunk_positions} positions.\n")  # fmt: skip
    print(settings_table(args.models, work, args.recompute_behavior_logprobs))
    if args.fsdp:
        print("\nShipped setting sharded with FSDP over k GPUs: peak per GPU (model states resident between steps).\n")
        print(fsdp_table(args.models, work, args.fsdp))
    if args.learner_ranks:
        print("\nShipped setting per learner rank under --trainer.strategy ddp / fsdp2 (lit_gmc's FSDP2: fp32 "
              "gathers, autocast) over k ranks: peak (model states resident between steps).\n")  # fmt: skip
        print(per_rank_table(args.models, work, args.learner_ranks, args.strategy))


if __name__ == "__main__":
    main()
