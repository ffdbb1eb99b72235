"""The cached tiny actor is keyed by everything that determines it (issue 13, item 8): its recipe, the source of the
code that builds and warm-starts it, and the versions of torch, transformers and tokenizers. A cache written by
other code or another library is never reused; the same inputs always find the same folder.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
from dataclasses import asdict, replace

from lit_gmc import actor
from lit_gmc.actor import TinyRecipe, ensure_tiny_actor

# A recipe small enough to build and warm-start in well under a second.
SMALL = TinyRecipe(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   warm_start_steps=2, warm_start_batch=4, max_operand=9)  # fmt: skip
# The library modules as actor.py imported them. (transformers 5 replaces its own sys.modules entry when some of
# its names are first imported, so a fresh `import transformers` here can be a different module object.)
LIBRARIES = (actor.torch, actor.transformers, actor.tokenizers)


def direct_key(recipe: TinyRecipe) -> str:
    """The key written out: SHA-256 of the recipe, the tokens, the builders' source and the library versions."""
    functions = [
        actor.build_char_tokenizer, actor.build_tiny_model, actor.addition_problems, actor.warm_start,
        actor.ensure_tiny_actor,
    ]  # fmt: skip
    blob = {
        "recipe": asdict(recipe),
        "tokens": {"alphabet": actor.TINY_ALPHABET, "special": list(actor.SPECIAL_TOKENS)},
        "code": [f"{fn.__qualname__}\n{inspect.getsource(fn)}" for fn in functions],
        "versions": {module.__name__: module.__version__ for module in LIBRARIES},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


def test_key_is_the_hash_of_recipe_code_and_versions_and_is_stable():
    key = TinyRecipe().key()
    assert key == direct_key(TinyRecipe())
    assert len(key) == 12 and int(key, 16) >= 0
    assert TinyRecipe().key() == key  # same inputs, same folder
    assert TinyRecipe(**asdict(TinyRecipe())).key() == key
    assert replace(TinyRecipe(), warm_start_steps=401).key() != key
    assert replace(TinyRecipe(), warm_start_lr=3.1e-3).key() != key


def test_versions_are_the_installed_ones():
    assert actor.library_versions() == {name: importlib.metadata.version(name) for name in
                                        ("torch", "transformers", "tokenizers")}  # fmt: skip


def test_key_changes_with_each_library_version(monkeypatch):
    key = TinyRecipe().key()
    for module in LIBRARIES:
        monkeypatch.setattr(module, "__version__", module.__version__ + ".post1")
        assert TinyRecipe().key() != key, module.__name__
        assert TinyRecipe().key() == direct_key(TinyRecipe())
        monkeypatch.undo()
        assert TinyRecipe().key() == key


def warm_start_v2(model, tokenizer, recipe):
    """Stands in for an edited warm start (any change to its source text)."""
    return [0.0] * recipe.warm_start_steps


def addition_problems_v2(max_operand):
    """Stands in for an edited problem set (another held-out rule)."""
    return [], []


def test_key_changes_when_the_building_code_changes(monkeypatch):
    key = TinyRecipe().key()
    for owner, name, new in (
        (actor, "warm_start", warm_start_v2),
        (actor, "build_tiny_model", lambda recipe, vocab_size, pad_id, eos_id: None),
        (actor, "build_char_tokenizer", lambda alphabet="abc": None),
        (actor, "addition_problems", addition_problems_v2),
    ):
        monkeypatch.setattr(owner, name, new)
        assert TinyRecipe().key() != key, name
        assert TinyRecipe().key() == direct_key(TinyRecipe())
        monkeypatch.undo()
        assert TinyRecipe().key() == key
    monkeypatch.setattr(actor, "TINY_ALPHABET", actor.TINY_ALPHABET + "!")
    assert TinyRecipe().key() != key


def test_a_cache_from_other_warm_start_code_is_not_reused(tmp_path, monkeypatch):
    """Build once; a second call finds that folder untouched. Under edited warm-start code (or another torch) the
    old folder is not reused: a new one is built beside it, by the new code."""
    first = ensure_tiny_actor(SMALL, tmp_path)
    assert first.name == f"tiny-{SMALL.key()}" and (first / "config.json").exists()
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_actor(SMALL, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    saved = json.loads((first / "lit_gmc_recipe.json").read_text())
    assert saved["versions"] == actor.library_versions() and saved["hidden_size"] == 16

    calls = []

    def edited_warm_start(model, tokenizer, recipe):
        calls.append(recipe)
        return [1.5]

    monkeypatch.setattr(actor, "warm_start", edited_warm_start)
    second = ensure_tiny_actor(SMALL, tmp_path)
    assert second != first and calls == [SMALL]
    assert json.loads((second / "lit_gmc_recipe.json").read_text())["warm_start_final_loss"] == 1.5
    monkeypatch.undo()

    monkeypatch.setattr(actor.torch, "__version__", actor.torch.__version__ + ".post1")
    third = ensure_tiny_actor(SMALL, tmp_path)
    assert third not in (first, second)
    monkeypatch.undo()
    assert ensure_tiny_actor(SMALL, tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (first, second, third))
