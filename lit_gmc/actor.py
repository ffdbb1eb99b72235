"""The actor: any transformers causal LM by hub name or local path, or ``"tiny"``, built here in code.

``"tiny"`` is a ~300k-parameter Qwen3-architecture model with a character tokenizer, warm-started on the addition
task so that RL has a reward signal from the first step, and saved once in the cache (``save_pretrained`` layout),
so that the learner, the HF engine and vLLM all load the same weights.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from lit_gmc.errors import UserError, UserFileNotFoundError, first_line

TINY_ALPHABET = "0123456789+-=*() abcdefghijklmnopqrstuvwxyz"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


@dataclass(frozen=True)
class TinyRecipe:
    """The numbers of the tiny actor; with the code and library versions that build it, they key its cache folder."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 64
    max_operand: int = 69
    warm_start_steps: int = 400
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 64
    seed: int = 0

    def key(self) -> str:
        """First 12 hex digits of the SHA-256 of :func:`tiny_actor_fingerprint` (recipe, code, versions)."""
        return hashlib.sha256(json.dumps(tiny_actor_fingerprint(self), sort_keys=True).encode()).hexdigest()[:12]


def tiny_alphabet_problem(prompts: Sequence[tuple[int, str]]) -> str | None:
    """Why the tiny actor's character tokenizer cannot encode these ``(id, text)`` prompts, or None.

    Its vocabulary is :data:`TINY_ALPHABET`: any other character would silently become ``<unk>``.
    """
    known = set(TINY_ALPHABET)
    unknown = sorted({char for _, text in prompts for char in text} - known)
    if not unknown:
        return None
    prompt_id, text = next((i, text) for i, text in prompts if set(text) - known)
    return (
        f"--model.actor tiny: its character tokenizer encodes only {TINY_ALPHABET!r}, and the task's prompts also hold "
        f"{''.join(unknown)!r} (first in prompt {prompt_id}: {text[:60]!r}), which it would read as <unk>; choose a "
        "model with a real tokenizer (--model.actor, a hub name or a local folder) or prompts in that alphabet"
    )


def context_problem(
    actor: str,
    prompts: Sequence[tuple[int, str]],
    max_new_tokens: int,
    tokenizer: Any = None,
    max_prompt_tokens: int | None = None,
) -> str | None:
    """Why the longest of these ``(id, text)`` prompts plus ``max_new_tokens`` exceeds ``actor``'s context, or None.

    Counted with ``tokenizer`` (``None``: the actor's own) without special tokens, as the engines encode prompts,
    against ``max_position_embeddings`` (if any). ``max_prompt_tokens`` is only named in the message.
    """
    from transformers import AutoConfig

    path = resolve_actor_path(actor, "--model.actor")
    context = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    if not prompts or not isinstance(context, int):
        return None
    tokenizer = tokenizer if tokenizer is not None else tokenizer_at(path, actor)
    lengths = [len(ids) for ids in tokenizer([text for _, text in prompts], add_special_tokens=False)["input_ids"]]
    longest = max(range(len(prompts)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens <= context:
        return None
    shorten = (
        f"lower --data.max_prompt_tokens (now {max_prompt_tokens})"
        if max_prompt_tokens is not None
        else "shorten the task's prompts (--data.max_prompt_tokens N keeps the last N tokens of each)"
    )
    return (
        f"prompt {prompts[longest][0]} of the task is {lengths[longest]} tokens, and with --data.max_new_tokens "
        f"{max_new_tokens} that is more than the {context} tokens --model.actor {actor} can attend to; {shorten} "
        "or lower --data.max_new_tokens"
    )


def build_char_tokenizer(alphabet: str = TINY_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer (one token per character) with pad, EOS and unk tokens."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_tiny_model(recipe: TinyRecipe, vocab_size: int, pad_id: int, eos_id: int) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 with the recipe's shape (tied embeddings, fp32)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # imported when a model is built: not for --help

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    torch.manual_seed(recipe.seed)
    return Qwen3ForCausalLM(config)


def addition_problems(max_operand: int) -> tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """``(id, "a+b=", "sum")`` rows for ``a, b`` in ``0..max_operand``: training rows, and held-out rows (one in ten).

    The held-out rule is ``(7a + 3b) % 10 == 0``. The tiny actor's warm start and the ``Addition`` task both read
    these rows, so the warm start never sees a held-out sum.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rows = [(i, f"{a}+{b}=", str(a + b)) for i, (a, b) in enumerate(pairs)]
    held_out = [(7 * a + 3 * b) % 10 == 0 for a, b in pairs]
    return [r for r, out in zip(rows, held_out, strict=True) if not out], [
        r for r, out in zip(rows, held_out, strict=True) if out
    ]


def warm_start(model: Qwen3ForCausalLM, tokenizer, recipe: TinyRecipe) -> list[float]:
    """Supervised steps on the answer tokens (answer + EOS) of the addition task's training prompts.

    Returns the loss per step. Only the training split is used, so held-out accuracy stays honest.
    """
    rows, _ = addition_problems(recipe.max_operand)
    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.warm_start_lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(recipe.warm_start_steps):
        picked = rng.sample(rows, recipe.warm_start_batch)
        prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text, _ in picked]
        answer_ids = [
            tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for _, _, answer in picked
        ]
        width = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids, strict=True))
        ids = torch.full((len(picked), width), tokenizer.pad_token_id)
        labels = torch.full((len(picked), width), -100)
        attention = torch.zeros((len(picked), width), dtype=torch.long)
        for row, (p, a) in enumerate(zip(prompt_ids, answer_ids, strict=True)):
            ids[row, : len(p) + len(a)] = torch.tensor(p + a)
            labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
            attention[row, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def tiny_actor_builders() -> list[Callable[..., Any]]:
    """The code that decides the cached actor: its builders, the warm start and its prompts, the saving."""
    return [build_char_tokenizer, build_tiny_model, addition_problems, warm_start, ensure_tiny_actor]


def library_versions() -> dict[str, str]:
    """Versions of the libraries that build, train and serialise the tiny actor."""
    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def tiny_actor_fingerprint(recipe: TinyRecipe) -> dict[str, Any]:
    """Everything that determines the cached tiny actor, as JSON-able data; its hash names the cache folder.

    The recipe's numbers, the source of :func:`tiny_actor_builders` and the :func:`library_versions`, so that a
    cache from other code or another torch is never reused silently (stale folders are left for the user to delete).
    """
    return {
        "recipe": asdict(recipe),
        "tokens": {"alphabet": TINY_ALPHABET, "special": list(SPECIAL_TOKENS)},
        "code": [f"{fn.__qualname__}\n{inspect.getsource(fn)}" for fn in tiny_actor_builders()],
        "versions": library_versions(),
    }


def default_cache_dir() -> Path:
    """``$LIT_GMC_CACHE`` if set, else ``~/.cache/lit_gmc``."""
    return Path(os.environ.get("LIT_GMC_CACHE", Path.home() / ".cache" / "lit_gmc"))


def ensure_tiny_actor(recipe: TinyRecipe | None = None, cache_dir: str | Path | None = None) -> Path:
    """Build, warm-start and save the tiny actor once; later calls return the cached folder.

    The folder is written under a temporary name and renamed into place, so a crash never leaves a
    half-written actor that later runs would trust.
    """
    recipe = recipe or TinyRecipe()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{recipe.key()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(recipe, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    losses = warm_start(model, tokenizer, recipe)
    staging = root / f".{target.name}.{os.getpid()}.tmp"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    record = {**asdict(recipe), "versions": library_versions(), "warm_start_final_loss": losses[-1]}
    (staging / "lit_gmc_recipe.json").write_text(json.dumps(record))
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def resolve_actor_path(actor: str, option: str = "actor") -> str:
    """``"tiny"`` becomes the cached tiny actor's folder; anything else is a hub name or local path.

    ``option`` names where ``actor`` came from, for messages (``--model.actor``, a task's tokenizer option...).

    Raises:
        UserError: For a local path that is missing, a file, or a folder without ``config.json``, and for a tiny
            actor cache that cannot be written.
    """
    if actor == "tiny":
        try:
            return str(ensure_tiny_actor())
        except OSError as err:  # e.g. $LIT_GMC_CACHE on a read-only or full disk
            raise UserError(
                f"{option} tiny: cannot write the tiny actor under {default_cache_dir()} ({err}); "
                "set $LIT_GMC_CACHE to a writable folder"
            ) from err
    check_local_actor(actor, option)
    return str(Path(actor).expanduser()) if actor.startswith("~") else actor  # "--model.actor=~/m": no shell expansion


def check_local_actor(actor: str, option: str) -> None:
    """Refuse a local ``actor`` that transformers could not load, with a message saying what it is instead.

    Else transformers looks a missing folder up on the hub, and words a checkpoint file or an empty folder badly.
    """
    path = Path(actor).expanduser()
    hint = "pass 'tiny', a hub name or a folder written by save_pretrained"
    if path.is_file():
        raise UserError(
            f"{option} {actor} is a file, not a model folder: {hint} "
            "(python -m lit_gmc export turns a lit_gmc checkpoint into one)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"{option} {actor} is not a transformers model folder (it has no config.json): {hint}")
    if path.exists():
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(actor)  # a hub name (``name`` or ``namespace/name``) is looked up there
    except HFValidationError:
        missing = f"no such model folder (resolved to {path.resolve()})"
        raise UserFileNotFoundError(f"{option} {actor}: {missing}; {hint}") from None


def load_error(actor: str, option: str, err: Exception) -> UserError:
    """The :class:`UserError` for transformers failing to load ``actor`` (offline, unknown repo, bad folder)."""
    reason = first_line(err)
    if Path(actor).expanduser().exists():
        return UserError(f"{option} {actor}: transformers cannot load it as a causal LM and tokenizer ({reason})")
    return UserError(
        f"{option} {actor} is no local folder, and loading it from the Hugging Face hub failed ({reason}); "
        "without network access, pass a local copy of the model (a folder written by save_pretrained)"
    )


def load_actor(actor: str, dtype: torch.dtype = torch.float32, option: str = "--model.actor"):
    """Load ``(model, tokenizer)``; the tokenizer gets a pad token (EOS) if it has none.

    ``option`` names where ``actor`` came from, for messages.

    Raises:
        UserError: For an actor that cannot be found or loaded (:func:`resolve_actor_path`; an unknown or
            unreachable hub name; a folder that is not a causal LM), naming ``option``.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_actor_path(actor, option)
    tokenizer = tokenizer_at(path, actor, option)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:  # transformers' errors for a name or folder it cannot load
        raise load_error(actor, option, err) from err
    return model, tokenizer


def load_tokenizer(actor: str, option: str = "--model.actor"):
    """The tokenizer of ``actor``, with a pad token (EOS) if it has none; a :class:`UserError` naming ``option``."""
    return tokenizer_at(resolve_actor_path(actor, option), actor, option)


def tokenizer_at(path: str, actor: str, option: str = "--model.actor"):
    """:func:`load_tokenizer` for an ``actor`` already resolved to ``path`` (:func:`resolve_actor_path`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise load_error(actor, option, err) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lit_gmc.actor [ACTOR]``: print the folder ``ACTOR`` loads from (default ``tiny``).

    For ``tiny``, the cache folder (built if need be), for ``vllm serve --model`` to serve ``--model.actor tiny``.
    """
    import sys

    actor = (list(sys.argv[1:]) if argv is None else list(argv)) or ["tiny"]
    try:
        print(resolve_actor_path(actor[0], "actor"))
    except UserError as err:
        print(f"lit_gmc: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
