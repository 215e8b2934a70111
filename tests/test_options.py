"""The option values (epochcache.options): each default written once, one keyword surface.

epochs()' 19 parameters were written out three times (``Cache.epochs``, its forwarding call,
``data.epochs.epochs``), 17 again in ``_Epochs``, and a run's config restated the defaults it
shares with the API. Now the fields of `ReaderOptions`, `EpochOptions` and `LoaderOptions` are
the one place each default is written: these tests fail when one is restated.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from epochcache import Cache, PrepareFailed
from epochcache.config import CacheConfig, LoaderConfig, TrainConfig
from epochcache.data.epochs import epochs
from epochcache.data.stream import CacheStream
from epochcache.options import (
    EPOCH_NAMES,
    LOADER_NAMES,
    EpochOptions,
    LoaderOptions,
    ReaderOptions,
    resolve_options,
)


def _keywords(fn: Any) -> dict[str, ast.expr | None]:
    """The keyword-only parameters of ``fn`` and their default, as written in its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    return {arg.arg: default for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults)}


@pytest.mark.parametrize(("fn", "own"), [
    (epochs, {"start_epoch", "resume", "options"}),
    (CacheStream.__init__, {"split_ranks", "options"}),
])
def test_each_default_of_a_signature_is_the_options(fn: Any, own: set[str]) -> None:
    """The keyword signatures name each option's default (``EpochOptions.seed``), never
    restate it; epochs() takes every epoch and loader option, stream() every epoch option."""
    keywords = _keywords(fn)
    options = EPOCH_NAMES | (LOADER_NAMES if fn is epochs else frozenset())
    assert set(keywords) == options | own
    for name in options:
        default = keywords[name]
        owner = "EpochOptions" if name in EPOCH_NAMES else "LoaderOptions"
        assert (isinstance(default, ast.Attribute) and isinstance(default.value, ast.Name)
                and default.value.id == owner and default.attr == name), \
            f"{fn.__qualname__}({name}=...): the default is restated; write {owner}.{name}"


def test_cache_forwards_the_keywords_as_they_are() -> None:
    """Cache.epochs() and Cache.stream() take the same keywords as epochs() and CacheStream:
    they forward them, restating neither a parameter nor a default."""
    for method, fixed in ((Cache.epochs, ["self", "num_epochs"]), (Cache.stream, ["self"])):
        params = list(inspect.signature(method).parameters.values())
        assert [p.name for p in params[:-1]] == fixed
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_the_configs_shared_defaults_are_the_apis() -> None:
    reader, epoch, loader = ReaderOptions(), EpochOptions(), LoaderOptions()
    shared = [(LoaderConfig, loader, ["batch_size", "num_workers", "persistent_workers"]),
              (LoaderConfig, reader, ["decode", "allow_pickle", "max_sample_bytes", "fields",
                                      "image", "stall_s", "stall_action"]),
              (TrainConfig, epoch, ["seed", "samples_per_epoch"]),
              (CacheConfig, epoch, ["resume_grace_s"])]
    for section, value, names in shared:
        for name in names:
            assert section.model_fields[name].default == getattr(value, name), name


def test_resolve_sends_each_keyword_to_its_value() -> None:
    reader, epoch, loader = resolve_options("f()", ReaderOptions(image="torch"), {
        "seed": 3, "batch_size": 5, "fields": ("npy",), "pin_memory": True}, loader=True)
    assert (reader.image, reader.fields) == ("torch", ("npy",))
    assert epoch == EpochOptions(seed=3)
    assert loader == LoaderOptions(batch_size=5, dataloader={"pin_memory": True})
    # Validation is the values' own, wherever they are made.
    for bad, match in (({"release": "never"}, "release"), ({"min_samples": -1}, "min_samples"),
                       ({"sampler": None}, "sets sampler itself")):
        with pytest.raises(ValueError, match=match):
            resolve_options("f()", None, bad, loader=True)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        EpochOptions(samples_per_epoch=0)
    assert {f.name for f in dataclasses.fields(LoaderOptions)} == LOADER_NAMES | {"dataloader"}


def test_an_unknown_keyword_errors_as_before(tmp_path: Path) -> None:
    """stream() and dataset() name it in a TypeError at once; epochs() hands it to each
    DataLoader, whose TypeError is the PrepareFailed's cause (as before the option values)."""
    cache = Cache(tmp_path / "c", "64MiB", sync=False)
    cache.put_many([(f"s/{i}.cls", b"1") for i in range(8)])
    with pytest.raises(TypeError, match=r"cache\.stream\(\): unexpected keyword .* bogus"):
        cache.stream(bogus=1)
    with pytest.raises(TypeError, match=r"cache\.stream\(\): unexpected keyword .* batch_size"):
        cache.stream(batch_size=2)  # a DataLoader's, not the stream's
    with pytest.raises(TypeError, match=r"cache\.dataset\(\): unexpected keyword .* seed"):
        cache.dataset(seed=1)  # an epoch's, not a dataset's
    with pytest.raises(TypeError, match=r"cache\.epochs\(\): options: expected"):
        cache.epochs(1, options=3)  # type: ignore[arg-type]
    with pytest.raises(PrepareFailed) as info:
        for _epoch, loader in cache.epochs(1, batch_size=4, bogus=1):
            list(loader)
    assert isinstance(info.value.__cause__, TypeError)
    assert "unexpected keyword argument 'bogus'" in str(info.value.__cause__)
    cache.close()
