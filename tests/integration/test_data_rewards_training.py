"""The data loaders and the rewards plug into STAPOTrainer as a TRL user would wire them."""

from tiny import build_char_tokenizer, build_tiny_qwen3, tiny_config

from stapo_trl import STAPOConfig, STAPOTrainer
from stapo_trl.data import load_dapo_math
from stapo_trl.rewards import get_reward_func


def test_a_training_step_on_the_dapo_sample_logs_each_reward_by_name(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    model = build_tiny_qwen3(tokenizer, max_position_embeddings=512)
    config = tiny_config(STAPOConfig, tmp_path, max_steps=1, log_completions=False)
    trainer = STAPOTrainer(
        model=model,
        reward_funcs=[get_reward_func("boxed"), get_reward_func("dapo"), get_reward_func("math_verify")],
        args=config,
        train_dataset=load_dapo_math("sample", prompt_style="boxed"),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    for name in ("boxed_reward", "dapo_reward", "math_verify_reward"):
        assert f"rewards/{name}/mean" in logged
    # An untrained model writes no answer: the exact rules give -1 and math-verify 0 to every completion.
    assert logged["rewards/boxed_reward/mean"] == -1.0
    assert logged["rewards/dapo_reward/mean"] == -1.0
    assert logged["rewards/math_verify_reward/mean"] == 0.0
    assert logged["math_verify/timeout_fraction"] == 0.0
