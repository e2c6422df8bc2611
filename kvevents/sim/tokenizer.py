"""The simulated engines' tokenizer: it lives in :mod:`kvevents.tokenizer` (a core module,
so ``kvevents serve`` tokenizes without loading the simulator); re-exported here."""

from kvevents.tokenizer import TOKENIZER_TYPE, SimTokenizer, load_sim_tokenizer, message_text

__all__ = ["TOKENIZER_TYPE", "SimTokenizer", "load_sim_tokenizer", "message_text"]
