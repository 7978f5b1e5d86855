"""A tokenizer process for corpus preparation (``prepare.ProcessEncoder``), run by path as
``python -P encode_worker.py TOKENIZER_JSON DTYPE`` so that it imports only ``tokenizers`` and
numpy (~15 MB), not torch (~270 MB, which importing the layershard package would cost).

Protocol on stdin/stdout, little-endian: a request is a uint32 count n (0: exit), n uint64 byte
lengths and the n UTF-8 texts; the reply is n uint64 token counts and the tokens as DTYPE.
"""

import struct
import sys

import numpy as np
from tokenizers import Tokenizer


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise SystemExit(0)  # the parent is gone
    return data


def main() -> None:
    tok = Tokenizer.from_file(sys.argv[1])
    dtype = np.dtype(sys.argv[2])
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        (n,) = struct.unpack("<I", _read(stdin, 4))
        if n == 0:
            return
        lengths = np.frombuffer(_read(stdin, 8 * n), dtype="<u8")
        data = _read(stdin, int(lengths.sum()))
        ends = np.cumsum(lengths).tolist()
        texts = [data[a:b].decode("utf-8") for a, b in zip([0] + ends[:-1], ends)]
        encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        counts = np.asarray([len(ids) for ids in encoded], dtype="<u8")
        ids = np.concatenate([np.asarray(e, dtype=dtype) for e in encoded])
        stdout.write(counts.tobytes())
        stdout.write(ids.astype(dtype.newbyteorder("<"), copy=False).tobytes())
        stdout.flush()


if __name__ == "__main__":
    main()
