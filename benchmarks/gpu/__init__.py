"""The sections of `benchmarks/gpu_check.py`: the statistics kernels, GRPO equivalence, the S2T mask and the cost, each
run on CUDA at the paper's shapes or on the CPU at toy sizes through the same code."""
