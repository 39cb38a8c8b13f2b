"""Layer classes of the Qwen4-Exp model. Tensor parallelism and expert/PLE offload live here."""
