"""Write the S1 request set of benchmarks/README.md as JSONL for `pagedserve bench serve --dataset FILE`.

256 requests; prompt lengths uniform in [16, 1024], output lengths uniform in [16, 256]; prompt
token ids uniform in [3, 32000), all from numpy.random.default_rng(0). Prompts are token-id lists.
"""
import json
import sys

import numpy as np

rng = np.random.default_rng(0)
n = 256
in_lens = rng.integers(16, 1025, size=n)
out_lens = rng.integers(16, 257, size=n)
with open(sys.argv[1] if len(sys.argv) > 1 else "s1.jsonl", "w") as f:
    for k, o in zip(in_lens, out_lens):
        f.write(json.dumps({"prompt": rng.integers(3, 32000, size=int(k)).tolist(), "output_len": int(o)}) + "\n")
