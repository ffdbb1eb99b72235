"""Rollout throughput (generated tokens/s) of HFEngine, VLLMEngine (in-process ``vllm.LLM.generate``) and VLLMServers
(one ``vllm serve`` process, ``--engines vllm-serve``), and the latency of a weight sync.

``--engines vllm-process`` is ``vllm.LLM.generate`` as vLLM runs it by default, its engine core in a process of its
own (``VLLMEngine`` keeps the core in the learner's process so that weights pass by reference): the same engine a
``vllm serve`` process runs, without the HTTP front end, so ``vllm-serve`` against it measures the serving layer
alone. It generates only (no weight sync).

Two actors: the warm-started tiny actor (the embedded default's shapes: B = 8 prompts x G = 8, 6 new tokens)
and a mid-size Qwen3 built here in code (~100M parameters, random weights, 32k vocabulary, 64 new tokens;
random weights almost never sample EOS, so every response has the full length). Each measurement is the
median of ``--repeats`` timed calls after a short warm-up call (2 new tokens). Run in an environment with vLLM installed
(``pip install -e ".[dev,cpu-vllm]"`` on CPU), e.g.:

    python scripts/bench/bench_rollout.py --models tiny mid --engines hf vllm
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gmc.actor import build_char_tokenizer, ensure_tiny_actor, load_actor
from lit_gmc.data.engines.base import SamplingParams
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.tasks.addition import Addition
from lit_gmc.data.tasks.base import Prompt


def mid_model(tokenizer, vocab: int, hidden: int, layers: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=8 * hidden // 3 // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def actors(names: list[str], workdir: Path, args) -> dict[str, tuple[str, object, object, list[Prompt], int]]:
    """name -> (folder, HF model, tokenizer, prompts, max_new_tokens)."""
    out = {}
    train = list(Addition().train_prompts())
    if "tiny" in names:
        path = str(ensure_tiny_actor())
        model, tokenizer = load_actor(path)
        out["tiny"] = (path, model, tokenizer, train[: args.prompts], 6)
    if "mid" in names:
        tokenizer = build_char_tokenizer()
        model = mid_model(tokenizer, args.mid_vocab, args.mid_hidden, args.mid_layers)
        path = workdir / "mid"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        prompts = [Prompt(p.id, (p.text + " ") * 4, p.answer) for p in train[: args.prompts]]  # ~30-token prompts
        out["mid"] = (str(path), model, tokenizer, prompts, args.mid_new_tokens)
    return out


def timed(fn, repeats: int, warm_up=None) -> tuple[float, object]:
    (warm_up or fn)()  # allocations, kernels, first-call overheads
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def engine_core_process_engine():
    """A ``VLLMEngine`` whose ``vllm.LLM`` runs its engine core in its own process, vLLM's default."""
    from lit_gmc.data.engines.vllm import VLLMEngine

    class EngineCoreProcess(VLLMEngine):
        def _start(self, model_path: str):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            return self.vllm.LLM(**self.llm_options(model_path))

    return EngineCoreProcess()


def build_engine(kind: str, path: str, model, tokenizer):
    if kind == "hf":
        return HFEngine.from_model(model, tokenizer)
    if kind == "vllm-serve":  # one `vllm serve` process started here; requests over HTTP, weights over gloo/NCCL
        from lit_gmc.data.engines.vllm_serve import VLLMServers

        engine = VLLMServers(launch=1)
        engine.start(path)
        return engine
    from lit_gmc.data.engines.vllm import VLLMEngine

    engine = engine_core_process_engine() if kind == "vllm-process" else VLLMEngine()
    engine.start(path, tokenizer=tokenizer)
    return engine


def bench(kind: str, name: str, actor, args) -> dict[str, float]:
    path, model, tokenizer, prompts, new_tokens = actor
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")  # where the learner's weights would live
    start = time.perf_counter()
    engine = build_engine(kind, path, model, tokenizer)
    startup = time.perf_counter() - start
    try:
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)
        short = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, seed=1)
        seconds, groups = timed(lambda: engine.generate(prompts, args.group_size, sampling), args.repeats,
                                warm_up=lambda: engine.generate(prompts, args.group_size, short))  # fmt: skip
        tokens = int(sum(int(g.response_mask.sum()) for g in groups))
        version = iter(range(1, 1000))
        sync = math.nan  # the engine core's process holds the weights: nothing to load in place
        if kind != "vllm-process":
            sync, _ = timed(lambda: engine.load_weights(model.named_parameters(), next(version)), args.repeats)
    finally:
        engine.close()
    params = sum(p.numel() for p in model.parameters())
    return {"params_M": params / 1e6, "startup_s": startup, "gen_s": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "sync_ms": 1e3 * sync}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=["tiny", "mid"])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"],
                        choices=["hf", "vllm", "vllm-process", "vllm-serve"])  # fmt: skip
    parser.add_argument("--prompts", type=int, default=8, help="B, prompts per call")
    parser.add_argument("--group-size", type=int, default=8, help="G, samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mid-hidden", type=int, default=768)
    parser.add_argument("--mid-layers", type=int, default=10)
    parser.add_argument("--mid-vocab", type=int, default=32768)
    parser.add_argument("--mid-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, actor in actors(args.models, Path(workdir), args).items():
            for kind in args.engines:
                row = bench(kind, name, actor, args)
                rows.append((name, kind, row))
                print(f"{name:5s} {kind:15s} " + "  ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
    print("\nmodel  engine           params(M)  startup(s)  tokens/s   sync(ms)")
    for name, kind, r in rows:
        print(f"{name:6s} {kind:15s} {r['params_M']:9.2f}  {r['startup_s']:10.1f}  {r['tokens_per_s']:8.0f}  "
              f"{r['sync_ms']:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
