"""TFDS builders for the math datasets and the procedural task (array_record, no TensorFlow).

Every builder writes the shared record schema (`sage_jax.data.sources.RECORD_FIELDS`) and is read
back with `tfds.data_source` / `builder.as_data_source(split)`, a random-access source that grain
indexes directly. Prepare from local files in `<manual_dir>/<name>/` (see `sources.SPECS` and
`sage_jax/data/README.md`), or from the hub when online:

    b = get_builder("math500", data_dir="~/tensorflow_datasets")
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=DIR))
    ds = b.as_data_source("test")      # or: load_split("math500", "test", manual_dir=DIR)

Splits: `train` for DAPO-Math-17k, `test` for the evaluation sets, `train` and `test` for the
procedural task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from sage_jax.data import procedural
from sage_jax.data.files import find_local_files, missing_message, resolve_files
from sage_jax.data.sources import SPECS, DataConfigError, SourceSpec, iter_records

VERSION = tfds.core.Version("1.0.0")
log = logging.getLogger(__name__)


def record_features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({
        "id": tfds.features.Text(),
        "problem": tfds.features.Text(),
        "answer": tfds.features.Text(),
        "solution": tfds.features.Text(),
        "source": tfds.features.Text(),
        "subject": tfds.features.Text(),
        "level": tfds.features.Scalar(dtype=np.int32),
    })


class _Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Common base: the source file of the class, found without `importlib_resources`."""

    # TFDS' own lookup touches the `importlib_resources` backport (absent on Python >= 3.9
    # installs) for builders that live inside a package.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path | None:
        return epath.Path(inspect.getfile(cls))


class _FileBuilder(_Builder, skip_registration=True):
    """A public release read from `<manual_dir>/<name>/` or fetched from the hub."""

    VERSION = VERSION
    SPEC: SourceSpec

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "SPEC" in cls.__dict__:
            cls.MANUAL_DOWNLOAD_INSTRUCTIONS = missing_message(cls.SPEC, None)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.SPEC.description,
            features=record_features(),
            homepage=(self.SPEC.url_base or f"https://huggingface.co/datasets/{self.SPEC.hub_repo}"),
            disable_shuffling=True,  # keep the release's order (grain shuffles at read time)
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        # The private attribute, because the public `manual_dir` asserts that it is non-empty.
        manual_dir = getattr(dl_manager, "_manual_dir", None)
        files = resolve_files(self.SPEC, manual_dir, dl_manager.download_dir)
        return {self.SPEC.split: self._generate_examples(files)}

    def _generate_examples(self, files):
        yield from iter_records(self.SPEC, files)


def _file_builder(name: str) -> type[_FileBuilder]:
    """The builder class of `sources.SPECS[name]` (`DapoMath17k`, `Math500`, ...)."""
    cls_name = "".join(part.capitalize() for part in name.split("_"))
    return type(cls_name, (_FileBuilder,), {"name": name, "SPEC": SPECS[name], "__module__": __name__})


FILE_BUILDERS = {name: _file_builder(name) for name in SPECS}


# ----------------------------------------------------------------------------- procedural


@dataclasses.dataclass(eq=False)
class ArithmeticBuilderConfig(tfds.core.BuilderConfig):
    """Knobs of the procedural task; the config name keys the prepared data on disk."""

    spec: procedural.ArithmeticSpec = dataclasses.field(default_factory=procedural.ArithmeticSpec)
    num_train: int = 5000  # distinct training problems
    num_test: int = 500  # distinct test problems (disjoint from train by hash)
    seed: int = 0


def arithmetic_config(
    name: str | None = None, num_train: int = 5000, num_test: int = 500, seed: int = 0, **knobs: Any
) -> ArithmeticBuilderConfig:
    """A config from knobs (`min_operands`, `max_operands`, `max_value`, `operators`, ...).

    Without a name, one is derived from every knob, so different knobs never share prepared data.
    """
    spec = procedural.ArithmeticSpec(**knobs)
    if name is None:
        ops = "".join({"+": "p", "-": "m", "*": "t", "/": "d"}[o] for o in spec.operators)
        frac = str(spec.test_fraction).replace(".", "p")
        lo = f"{spec.min_value}_" if spec.min_value else ""
        mix = "".join(f"_{n}{w:g}".replace(".", "p") for n, w in spec.strategy_mix)
        name = (f"n{spec.min_operands}_{spec.max_operands}_v{lo}{spec.max_value}_{ops}_f{frac}"
                f"_tr{num_train}_te{num_test}_s{seed}{mix}")
    return ArithmeticBuilderConfig(name=name, version=VERSION, spec=spec, num_train=num_train,
                                   num_test=num_test, seed=seed)


# The embedded testbed (configs/tiny.py, experiments/tiny_base/). `strategies_sft` is the base model's SFT
# corpus: 3-5 operands in 1..9 with + - *, worked solutions mixing two correct and two wrong procedures
# (`sage_jax.data.strategies`), the correct ones a minority and `terms` rare. `strategies` is what RL trains
# and is evaluated on: the same, plus 6-operand problems the base never saw (it rarely solves them, which
# leaves room at large k). Both splits hash the expression alike, so no test problem is in either train split;
# 50k training problems, so every RL step draws fresh ones.
STRATEGY_MIX = (("rule", 0.2), ("terms", 0.05), ("left", 0.5), ("right", 0.25))
STRATEGIES_SFT_TASK = dict(min_operands=3, max_operands=5, min_value=1, max_value=9, operators="+-*",
                           strategy_mix=STRATEGY_MIX, num_train=50000, num_test=500)
STRATEGIES_TASK = dict(STRATEGIES_SFT_TASK, max_operands=6)


class ProceduralArithmetic(_Builder):
    """Multi-step integer arithmetic with worked solutions; no network, no files."""

    name = "procedural_arithmetic"
    VERSION = VERSION
    BUILDER_CONFIGS = [
        arithmetic_config("default"),
        arithmetic_config("easy", min_operands=2, max_operands=3, operators="+-", num_train=2000,
                          num_test=200),
        arithmetic_config("hard", min_operands=3, max_operands=5, max_value=20, operators="+-*/",
                          num_train=20000, num_test=1000),
        arithmetic_config("strategies", **STRATEGIES_TASK),
        arithmetic_config("strategies_sft", **STRATEGIES_SFT_TASK),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"Procedural integer arithmetic: {self.builder_config.spec}",
            features=record_features(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        del dl_manager
        c = self.builder_config
        return {"train": self._generate_examples("train", c.num_train),
                "test": self._generate_examples("test", c.num_test)}

    def _generate_examples(self, split: str, n: int):
        c = self.builder_config
        for rec in procedural.generate(c.spec, split, n, seed=c.seed):
            yield rec["id"], rec


BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    **FILE_BUILDERS, ProceduralArithmetic.name: ProceduralArithmetic}


def get_builder(
    name: str, data_dir: str | os.PathLike | None = None,
    config: str | ArithmeticBuilderConfig | None = None,
) -> tfds.core.GeneratorBasedBuilder:
    """The builder for `name` (a key of `BUILDERS`), writing array_record files."""
    if name not in BUILDERS:
        raise DataConfigError(f"unknown dataset {name!r}; known: {sorted(BUILDERS)}")
    if isinstance(config, str) and config not in {c.name for c in BUILDERS[name].BUILDER_CONFIGS or ()}:
        known = sorted(c.name for c in BUILDERS[name].BUILDER_CONFIGS or ())
        raise DataConfigError(f"{name} has no builder config {config!r}; known: {known}")
    kwargs: dict[str, Any] = {"file_format": "array_record"}
    if data_dir is not None:
        kwargs["data_dir"] = os.fspath(os.path.expanduser(data_dir))
    if config is not None:
        kwargs["config"] = config
    return BUILDERS[name](**kwargs)


FINGERPRINT_FILE = "source_fingerprint.json"


def source_fingerprint(files) -> list[list]:
    """[name, size, sha1] of each source file: what a prepared copy was made from."""
    out = []
    for f in files:
        h = hashlib.sha1()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        out.append([os.path.basename(f), os.path.getsize(f), h.hexdigest()])
    return out


def load_split(
    name: str, split: str, data_dir: str | os.PathLike | None = None,
    manual_dir: str | os.PathLike | None = None,
    config: str | ArithmeticBuilderConfig | None = None,
):
    """Prepare `name` if needed and return the random-access source of `split`.

    A release read from local files is keyed on their content: the prepared copy records the files' sizes and
    hashes (`source_fingerprint.json`), and a copy whose files changed since (an edited answer, a replaced
    parquet) is prepared again, with a warning, instead of being read stale."""
    b = get_builder(name, data_dir, config)
    dl_config = tfds.download.DownloadConfig(
        manual_dir=os.fspath(os.path.expanduser(manual_dir)) if manual_dir else None
    )
    local = find_local_files(SPECS[name], manual_dir) if name in SPECS else []
    fingerprint = source_fingerprint(local) if local else None
    stamp = os.path.join(os.fspath(b.data_dir), FINGERPRINT_FILE)
    if fingerprint is not None and os.path.isfile(os.path.join(os.fspath(b.data_dir), "dataset_info.json")):
        try:
            with open(stamp) as f:
                stored = json.load(f)
        except (OSError, ValueError):
            stored = None
        if stored != fingerprint:
            log.warning("%s: %s changed since %s was prepared from it (or its record is missing); preparing "
                        "it again", name, ", ".join(str(p) for p in local), b.data_dir)
            shutil.rmtree(os.fspath(b.data_dir))
            b = get_builder(name, data_dir, config)
    b.download_and_prepare(download_config=dl_config)
    if fingerprint is not None and not os.path.isfile(stamp):
        with open(stamp, "w") as f:
            json.dump(fingerprint, f)
    if split not in b.info.splits:
        raise DataConfigError(f"{name} has no split {split!r}; it has {sorted(b.info.splits)}")
    return b.as_data_source(split)
