"""Process-level facts every stage asks the same way: the device (one CUDA check), the trainer's CPU
threads next to a rollout engine, and derived seeds. Imports nothing of qerl."""
