"""The sections of `benchmarks/gpu_check.py`: the statistics kernels, GRPO equivalence, the S2T mask and the cost, each
run on CUDA at the paper's shapes or on the CPU at toy sizes through the same code; round two's quickstart recipe and
first-run sections; and the tools that bring round two's files to the GPU machine in parts (`parts`, `wheelhouse`,
`prepare_round_two`, `device_run`; README.md here has the plan of calls)."""
