"""Cost of the disk prefix cache's payload checksum (octo.scheduler.disk_cache) next to reading the payload: xxh3-64
(what octo
uses), CRC-32 (its fallback) and BLAKE2b, on payloads the size of a 2,000-token prefix of a 0.5B model (12 KB of KV
a token) and of an 8B GQA model (128 KB a token). Best of 3 each; run under ``flock /tmp/octo-bench.lock``.

    python bench/checksum.py [--out bench/results/checksum.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import zlib

from octo.scheduler.disk_cache import checksum

SIZES = {"2000 tokens, 0.5B model (12 KB/token)": 24, "2000 tokens, 8B GQA model (128 KB/token)": 256}


def best(fn, arg, n=3) -> float:
    out = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn(arg)
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/checksum.json")
    args = ap.parse_args()
    rows = []
    for what, mb in SIZES.items():
        data = os.urandom(mb << 20)
        with tempfile.NamedTemporaryFile(delete=False) as f:
            f.write(data)
            path = f.name

        def read(p):
            with open(p, "rb") as f:
                f.read()

        try:
            ms = {"read_page_cache": best(read, path), "xxh3_64": best(checksum, data),
                  "crc32": best(zlib.crc32, data), "blake2b": best(lambda d: hashlib.blake2b(d).digest(), data)}
        finally:
            os.unlink(path)
        row = {"payload": what, "mb": mb, **{k: round(v * 1000, 1) for k, v in ms.items()}}
        print(json.dumps(row))
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"unit": "ms, best of 3", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
