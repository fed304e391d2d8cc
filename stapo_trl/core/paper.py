"""The STAPO paper (arXiv 2602.15620): its title, identifier and citation, which the trainer's model card cites."""

from __future__ import annotations

import textwrap

PAPER_TITLE = "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens"
PAPER_ID = "2602.15620"
PAPER_URL = f"https://arxiv.org/abs/{PAPER_ID}"
STAPO_CITATION = textwrap.dedent("""\
    @article{liu2026stapo,
        title        = {{STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens}},
        author       = {Shiqi Liu and Zeyu He and Guojian Zhan and Letian Tao and Zhilong Zheng and Jiang Wu and Yinuo Wang and Yang Guan and Kehua Sheng and Bo Zhang and Keqiang Li and Jingliang Duan and Shengbo Eben Li},
        year         = 2026,
        eprint       = {arXiv:2602.15620},
        doi          = {10.48550/arXiv.2602.15620},
        url          = {https://arxiv.org/abs/2602.15620},
    }""")
