"""The embedded tiny MoE transformer, its tokenizer and its batched inference engine.

Modules (import them directly; this package imports nothing, so ``t1async.model.tokenizer`` stays light):

    config.py           MoEConfig (frozen; config.json)
    moe.py              MoETransformer: full forward (+ routing replay, value head) and KV-cached decoding
    weights.py          save_pretrained, load_pretrained, load_weights_into, default_model_dir
    tokenizer.py        ChatTokenizer (byte-level BPE, ChatML template, exact-ID pieces)
    train_tokenizer.py  python -m t1async.model.train_tokenizer: regenerate the shipped tokenizer
    engine.py           Engine, EngineConfig, GenRequest, GenEvent, GenResult: continuous batching, prefix reuse
    scheduler.py        the engine's synchronous step (prefill, decode, retire); kvcache.py, sampling.py
    speed.py            python -m t1async.model.speed: decode tokens/s at several batch sizes
"""

# This package imports nothing (its modules stay light to import): import the modules directly.
__all__: list[str] = []
