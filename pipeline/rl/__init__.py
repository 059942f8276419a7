"""LoRA GRPO training: the objective (``objective``), per-token logprobs (``logprobs``), the train
config (``train_config``), scored batches (``batch``), the policy and its optimizer (``policy``), one RL
step's update (``step``) and the checkpoint (``checkpoint``). May import ``runtime``, ``config``,
``store``, ``nvfp4`` (and ``qerl.kernels`` through it); never ``rollout``, ``evaluation``,
``registry`` or ``planning``."""
