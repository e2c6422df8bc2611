"""The index's content keys are deterministic and independent of engine hashing."""

from __future__ import annotations

import os
import subprocess
import sys

from kvevents.consumers.content import chain_units, prompt_keys, root_key

SCRIPT = (
    "from kvevents.consumers.content import prompt_keys;"
    "print(prompt_keys(list(range(64)), 16, 'adapter'))"
)


def test_keys_do_not_depend_on_the_python_hash_seed() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.getcwd())
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                             text=True, check=True, timeout=60)  # fmt: skip
        outs.add(run.stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(prompt_keys(list(range(64)), 16, "adapter"))


def test_prompt_keys_chain_like_engine_blocks_of_any_multiple_of_the_unit() -> None:
    tokens = list(range(1000, 1100))
    keys = prompt_keys(tokens, 16)
    assert len(keys) == 6  # whole units only
    # a 32-token engine block ends at the same key as two 16-token units
    assert chain_units(root_key(None), tokens[:32], 16) == keys[1]
    assert chain_units(keys[1], tokens[32:96], 16) == keys[5]
    assert prompt_keys(tokens, 16, "a") != keys and prompt_keys(tokens, 16, "a")[0] != keys[0]
    assert prompt_keys([*tokens[:15], 7, *tokens[16:]], 16)[0] != keys[0]
