"""Tokenization throughput: ``zinf_data`` building its token cache from a JSONL file, against
transformers' tokenizer called on the same file in a plain loop. (Not named ``tokenize.py``: every
script in this folder would import it in place of the standard library's ``tokenize``.)

A JSONL file of ``{"text": ...}`` lines (``--mb`` MB, default 100; ``--quick`` 10) of made-up words
is written to a temporary directory with a byte-level BPE trained on a sample of it
(``zinf_data.tiny``; nothing is downloaded), split into ``--parts`` files (default 10). This shared
machine's load moves from second to second, so the two sides are timed in turns part by part (the
order flipping every part) and each side's time is its sum over the parts; ``--rounds`` such passes
(the median pass is reported). The two sides:

- ``zinf_data``: ``zinf_data.tokenized(...)`` into a fresh cache directory: reading and checking
  every line, tokenizing in batches of ``cache.CHUNK`` records (the fast tokenizer's own threads
  work on a batch), BOS and EOS, writing tokens and mask, renaming the entry into place;
- ``plain_loop``: ``for line in f: tok(json.loads(line)["text"])["input_ids"]`` (collecting the
  ids).

Both produce the same ids (checked). Then each part's cache entry is checked again as a later run's
open checks it (``zinf_data.cache_check.check_files``, the files in the page cache as after a
build): with its verification (every file's crc32c, every id and mask byte) and with
``verify=False`` (the lengths only); the difference is the verification's time, and ``verify_cost``
is (tokenizing + verifying) / tokenizing the same data (goal <= 1.05). The last line is JSON with
tokens/s of each side (the median pass), ``vs_plain_loop`` (goal >= 1.0), the cache's size and
``verify_cost``. The generated files are deleted.

    python benchmarks/tokenization.py --quick
"""

import os
import sys

# This file's name is the standard library's `tokenize` (which Python itself imports): take its
# folder off the import path before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import zinf_data as zd  # noqa: E402
from zinf_data import cache_check  # noqa: E402
from zinf_data.tiny import tiny_tokenizer  # noqa: E402


def write_jsonl(paths: list[str], n_bytes: int, seed: int = 0) -> list[str]:
    """Lines of ~1 KB of made-up words, ``n_bytes`` in all over ``paths``; returns a sample of
    texts."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]
    sample = []
    for path in paths:
        written = 0
        with open(path, "w") as f:
            while written < n_bytes // len(paths):
                text = " ".join(rng.choices(words, k=170)) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
                if len(sample) < 2000:
                    sample.append(text)
    return sample


def plain_loop(path: str, tok) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    with open(path) as f:
        for line in f:
            n += len(tok(json.loads(line)["text"])["input_ids"])
    return time.perf_counter() - t0, n


def ours(path: str, tok, tok_dir: str, cache: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    data = zd.tokenized([path], "text", tok, tok_dir, cache, progress=False)
    seconds = time.perf_counter() - t0
    return seconds, len(data.tokens) - len(data)  # without the EOS each document gets


def verification(path: str, tok, tok_dir: str, cache: str, verify: bool) -> tuple[float, int]:
    """(seconds, bytes of the entry) of checking the built entry of ``path`` again as an open does
    (``cache_check.check_files``), with its checksums and id scan (``verify``) or without."""
    entry = zd.tokenized([path], "text", tok, tok_dir, cache, progress=False, verify=False).path
    meta = cache_check.read_meta(entry)
    t0 = time.perf_counter()
    cache_check.check_files(entry, meta, verify)
    seconds = time.perf_counter() - t0
    return seconds, sum(os.path.getsize(os.path.join(entry, f)) for f in os.listdir(entry))


def one_pass(paths: list[str], tok, tok_dir: str, cache: str) -> tuple[dict, dict]:
    """(seconds, tokens) of each side over every part, timed in turns part by part."""
    seconds = {"zinf_data": 0.0, "plain_loop": 0.0, "verify": 0.0, "no_verify": 0.0}
    tokens = {"zinf_data": 0, "plain_loop": 0, "cache_bytes": 0}
    for i, path in enumerate(paths):
        for name in ("zinf_data", "plain_loop") if i % 2 == 0 else ("plain_loop", "zinf_data"):
            s, n = ours(path, tok, tok_dir, cache) if name == "zinf_data" else plain_loop(path, tok)
            seconds[name] += s
            tokens[name] += n
        for verify in (True, False) if i % 2 == 0 else (False, True):
            s, nbytes = verification(path, tok, tok_dir, cache, verify)
            seconds["verify" if verify else "no_verify"] += s
        tokens["cache_bytes"] += nbytes
    return seconds, tokens


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--quick", action="store_true", help="10 MB, 2 passes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", type=int, default=10)
    args = p.parse_args(argv)
    mb, rounds = (10.0, 2) if args.quick else (args.mb, args.rounds)
    with tempfile.TemporaryDirectory(prefix="zinf-tokenize-") as tmp:
        paths = [os.path.join(tmp, f"data{i}.jsonl") for i in range(args.parts)]
        sample = write_jsonl(paths, int(mb * 2**20))
        tok_dir = os.path.join(tmp, "tok")
        tok = tiny_tokenizer(tok_dir, sample, vocab_size=4096)
        passes = [
            one_pass(paths, tok, tok_dir, os.path.join(tmp, f"cache{r}")) for r in range(rounds)
        ]
        counts = passes[0][1]
        cache_mb = counts.pop("cache_bytes") / 2**20
        verify_s = statistics.median(s["verify"] - s["no_verify"] for s, _ in passes)
        tokenize_s = statistics.median(s["zinf_data"] for s, _ in passes)
        if counts["zinf_data"] != counts["plain_loop"]:
            raise AssertionError(f"token counts differ: {counts}")
        tps = {k: counts[k] / statistics.median(s[k] for s, _ in passes) for k in counts}
        result = {
            "benchmark": "tokenize",
            "mb": mb,
            "tokens": counts["plain_loop"],
            "rounds": rounds,
            "parts": args.parts,
            "threads": os.cpu_count(),
            "zinf_data_tokens_per_s": round(tps["zinf_data"]),
            "plain_loop_tokens_per_s": round(tps["plain_loop"]),
            "vs_plain_loop": round(tps["zinf_data"] / tps["plain_loop"], 2),
            "cache_mb": round(cache_mb, 1),
            "verify_s": round(verify_s, 4),
            "verify_cost": round((tokenize_s + verify_s) / tokenize_s, 4),
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
