"""Multi30k task 1 for a user who cloned the repository: download, verify, cache.

    translator data multi30k [--data-dir DIR] [--base-url URL]

The files (``{train,val,test_2016_flickr}.{de,en,fr,cs}.gz``, raw and cased) come from the
dataset's public home, the Multi30k repository's ``data/task1/raw``, and are checked against
the SHA-256 sums below. Downloads go through ``pooch``: each file is written to a temporary
name and moved into place only once complete and verified, so an interrupted transfer or a
wrong checksum never leaves a file behind (the next run downloads it again).

Where the files live: ``--data-dir`` when given; else the workplace's shared copy beside
the repository (``model.training.data.MULTI30K_DIR``) if it is there; else the platform's cache folder
(``~/.cache/transformer-translator/multi30k`` on Linux). A folder that already holds a file is
used as it is (a local copy, e.g. ``../shared/data/multi30k``, stays a valid override); only
missing files are fetched, and fetched files are always verified.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from model.training.data import MULTI30K_DIR

log = logging.getLogger(__name__)

BASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
SPLITS = ("train", "val", "test_2016_flickr")
LANGUAGES = ("de", "en", "fr", "cs")
# SHA-256 of each file, taken from the copy this project trains on (../shared/data/multi30k,
# itself from the repository above).
SHA256 = {
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}


class DataError(RuntimeError):
    """A file could not be had: no connection, a server error, or a checksum that does not match."""


def cache_dir() -> Path:
    import pooch

    return Path(pooch.os_cache("transformer-translator")) / "multi30k"


def default_dir() -> Path:
    """The shared copy beside the repository when present, else the platform cache folder."""
    return MULTI30K_DIR if MULTI30K_DIR.is_dir() else cache_dir()


def file_names(splits: Iterable[str] = SPLITS, languages: Iterable[str] = LANGUAGES) -> list[str]:
    names = [f"{split}.{lang}.gz" for split in splits for lang in languages]
    unknown = [n for n in names if n not in SHA256]
    if unknown:
        raise ValueError(f"not Multi30k task 1 files: {', '.join(unknown)}")
    return names


def fetch(names: Sequence[str], data_dir: Path | None = None, base_url: str = BASE_URL) -> Path:
    """Make sure ``data_dir`` (default: ``default_dir()``) holds these files, downloading and
    verifying the missing ones; -> the folder. Raises ``DataError``."""
    import pooch
    import requests

    folder = default_dir() if data_dir is None else data_dir
    missing = [name for name in names if not (folder / name).is_file()]
    if not missing:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    downloader = pooch.HTTPDownloader(progressbar=sys.stderr.isatty(), timeout=60)
    for name in missing:
        log.info("downloading %s%s into %s", base_url, name, folder)
        try:
            pooch.retrieve(
                base_url + name, known_hash=f"sha256:{SHA256[name]}", fname=name, path=folder, downloader=downloader
            )
        except ValueError as err:  # pooch: the downloaded file's hash does not match (it is deleted)
            raise DataError(f"{name}: {err}") from None
        except (requests.RequestException, OSError) as err:
            raise DataError(f"{name}: download from {base_url} failed: {err}") from None
    return folder


def ensure_split_files(data_dir: str | Path, splits: Iterable[str], languages: Iterable[str]) -> Path:
    """The folder training or evaluation reads: ``data_dir`` if it holds the files; if it does
    not exist, the default folder; missing Multi30k files downloaded either way."""
    names = [f"{split}.{lang}.gz" for split in splits for lang in languages]
    folder = Path(data_dir)
    if not all((folder / n).is_file() for n in names) and not folder.is_dir():
        log.warning("%s not found: using the Multi30k copy in %s", folder, default_dir())
        folder = default_dir()
    if all((folder / n).is_file() for n in names):
        return folder
    unknown = [n for n in names if n not in SHA256 and not (folder / n).is_file()]
    if unknown:
        raise DataError(f"{', '.join(unknown)} not in {folder}, and not Multi30k files that could be downloaded")
    return fetch(names, folder)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="translator data multi30k",
        description="Download Multi30k task 1 (train, val, test_2016_flickr; de en fr cs), verify each "
        "file's SHA-256 and keep it in a cache folder.",
    )
    parser.add_argument("--data-dir", type=Path, help=f"where to keep the files (default: {default_dir()})")
    parser.add_argument("--base-url", default=BASE_URL, help="where to download from (a mirror)")
    parser.add_argument("--splits", default=",".join(SPLITS), help="comma-separated")
    parser.add_argument("--languages", default=",".join(LANGUAGES), help="comma-separated")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        names = file_names(args.splits.split(","), args.languages.split(","))
        folder = fetch(names, args.data_dir, args.base_url if args.base_url.endswith("/") else args.base_url + "/")
    except (ValueError, DataError) as err:
        log.error("%s", err)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
