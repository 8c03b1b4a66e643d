"""Where a dataset's files are: `<manual_dir>/<name>/` first, then the Hugging Face hub (or the release's own
URL) when online; otherwise a `ManualFileMissingError` that says which file to put where."""

from __future__ import annotations

import os
from pathlib import Path

from sage_jax.data.sources import DATA_SUFFIXES, ManualFileMissingError, SourceSpec


def manual_subdir(spec: SourceSpec, manual_dir: str | os.PathLike) -> Path:
    return Path(manual_dir).expanduser() / spec.name


def find_local_files(spec: SourceSpec, manual_dir: str | os.PathLike | None) -> list[Path]:
    """The release files in `<manual_dir>/<name>/`, as the hub lays them out (`en/train-....parquet`) or by
    base name, else any parquet/jsonl/json file there."""
    if manual_dir is None:
        return []
    d = manual_subdir(spec, manual_dir)
    named = [p for f in spec.hub_files for p in (d / f, d / Path(f).name) if p.is_file()][:len(spec.hub_files)]
    if named:
        return named
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)


def missing_message(spec: SourceSpec, manual_dir: str | os.PathLike | None, why: str = "") -> str:
    d = manual_subdir(spec, manual_dir or "~/tensorflow_datasets/downloads/manual")
    wanted = ", ".join(str(d / Path(f).name) for f in spec.hub_files)
    urls = ", ".join(spec.urls())
    return (
        f"{spec.name}: data file not found. Place {wanted} (download it from {urls}; "
        f"fields: {spec.fields}), or any .parquet/.jsonl/.json file with those fields in {d}/"
        + (f". Hub download was not possible: {why}" if why else "")
    )


def offline() -> bool:
    return any(os.environ.get(k, "") not in ("", "0", "false", "False")
               for k in ("HF_HUB_OFFLINE", "SAGE_JAX_OFFLINE"))


def fetch_from_hub(spec: SourceSpec, download_dir: str | os.PathLike) -> list[Path]:
    """Download the release files from the Hugging Face hub, or `spec.url_base` (raises on any failure)."""
    if spec.url_base:
        import urllib.request

        d = manual_subdir(spec, download_dir)
        d.mkdir(parents=True, exist_ok=True)
        out = []
        for url, f in zip(spec.urls(), spec.hub_files):
            dest = d / Path(f).name
            part = dest.with_name(dest.name + ".part")  # a broken download is never taken for the file
            urllib.request.urlretrieve(url, part)
            os.replace(part, dest)
            out.append(dest)
        return out
    from huggingface_hub import hf_hub_download

    out = []
    for f in spec.hub_files:
        p = hf_hub_download(spec.hub_repo, f, repo_type="dataset",
                            local_dir=str(Path(download_dir) / spec.name))
        out.append(Path(p))
    return out


def resolve_files(
    spec: SourceSpec,
    manual_dir: str | os.PathLike | None,
    download_dir: str | os.PathLike | None,
    allow_hub: bool = True,
) -> list[Path]:
    """Local files first, then the hub; otherwise a `ManualFileMissingError` saying what to do."""
    files = find_local_files(spec, manual_dir)
    if files:
        return files
    why = "offline (HF_HUB_OFFLINE / SAGE_JAX_OFFLINE set)" if offline() else ""
    if allow_hub and not offline() and download_dir is not None:
        try:
            return fetch_from_hub(spec, download_dir)
        except Exception as e:  # noqa: BLE001  (no network, no auth, renamed file, ...)
            why = f"{type(e).__name__}: {e}"
    elif not allow_hub:
        why = why or "hub downloads disabled"
    raise ManualFileMissingError(missing_message(spec, manual_dir, why))
