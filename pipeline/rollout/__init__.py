"""Rollout engines: the protocol (``protocol``), the config (``config``), prompt encoding, the one mode
decision and the factory (``factory``), the lazily built engine (``lazy``), the vLLM and transformers
implementations (``vllm_engine``, ``hf_engine``) and AQN (``aqn``; ``aqn_vllm`` is its vLLM worker
extension, named by string, and the model loader that holds a compiled engine's norms in fp32). May
import ``runtime``, ``config``, ``store``, ``nvfp4`` and ``data``; never ``rl``, ``evaluation``,
``registry`` or ``planning``."""
