#!/usr/bin/env bash
# STAPO on Qwen3-1.7B-Base, DAPO-Math-17K, in verl 0.9.1: the STAPO paper's run (arXiv 2602.15620, Table 2), with the
# batch arithmetic of stapo.yaml beside this file (tests/verl_plugin/test_verl_recipe.py checks the two agree).
# NOT RUN ON A GPU by this project: its keys are checked against verl's own config, its numbers against stapo.yaml.
#
# Setup (docs/verl.md): pip install -e ".[verl]" in a clone of stapo-trl on every node (it installs verl[verl-core],
# which the v1 trainer needs), plus verl's GPU stack (vLLM, flash-attn) as verl's install guide says. The data is the
# DAPO team's verl-format parquet (data_source math_dapo, scored by verl's own math_dapo reward):
#   hf download BytedTsinghua-SIA/DAPO-Math-17k --repo-type dataset --local-dir ~/data/dapo-math-17k
# 1 node x 8 GPUs with 80 GB each, as stapo.yaml.
#
# Batch arithmetic:
#   per generation:     256 prompts x 8 rollouts = 2048 completions (data.train_batch_size x rollout.n)
#   per optimizer step: 64 prompts x 8 = 512 completions (ppo_mini_batch_size x rollout.n): 4 steps per generation
#   per micro-batch:    4 completions per GPU, so 512 / (4 x 8) = 16 micro-batches per GPU and step
# The S2T pool: verl calls the loss per micro-batch, so each tau_h is taken over the 4 x 8 = 32 completions of one
# micro-batch of every GPU, not over the step's 512 (docs/verl.md, "What is pooled where").
#
# The paper's pool, over the step's 512 completions, with p and H of the policy before the update (docs/verl.md,
# "The whole mini-batch as the pool"): pass these arguments, which override the lines below (the last value wins):
#   ./verl-stapo.sh trainer.v1.trainer_mode=stapo_sync actor_rollout_ref.actor.policy_loss.loss_mode=vanilla \
#       actor_rollout_ref.actor.calculate_entropy=False
#
# Lines beyond verl's defaults that are not the paper's hyperparameters:
#   trainer.use_v1=True           verl's default trainer, stated: the stapo_sync trainer mode exists only there
#   actor._target_=...            stapo-trl's actor config: every process that builds it (driver, actor workers)
#                                 stops at start-up if stapo-trl is missing, the loss_mode unknown or
#                                 calculate_entropy off (docs/verl.md, "Checked at start-up")
#   entropy_checkpointing=True    recomputes the entropy in the backward pass instead of keeping its graph
#                                 (docs/verl.md, "What the entropy costs in memory")
set -euo pipefail
DATA="${DATA:-$HOME/data/dapo-math-17k/data/dapo-math-17k.parquet}"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA" \
    data.val_files="$DATA" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=15360 \
    data.filter_overlong_prompts=True \
    actor_rollout_ref.model.path=Qwen/Qwen3-1.7B-Base \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor._target_=stapo_trl.verl.actor_config.CheckedFSDPActorConfig \
    actor_rollout_ref.actor.policy_loss.loss_mode=stapo \
    actor_rollout_ref.actor.calculate_entropy=True \
    actor_rollout_ref.actor.entropy_checkpointing=True \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    trainer.use_v1=True \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    trainer.save_freq=20 \
    trainer.test_freq=-1 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name=stapo-verl \
    trainer.experiment_name=qwen3-1.7b-base-stapo \
    "$@"
