"""Engines: what runs the target and the drafter. `torch_engine` (the runtime in this library, every
platform), `llamacpp` (llama.cpp through llama-cpp-python, platform mn, from the files `llama_gguf`
writes) and `reference` (transformers' own decoding: the exactness oracle). The first two implement
the `Engine` protocol of `draftexpert.speculation.round`, so one round and one AR loop run on both."""
