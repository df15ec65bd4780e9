"""A reward model: an HF sequence classifier scoring ``prompt + response``.

With one label the score is its logit; with several, the logit of the last label (the usual
"good" class of a binary preference classifier).
"""

from __future__ import annotations

from pathlib import Path


class ModelReward:
    """Scores with a local ``AutoModelForSequenceClassification`` directory, in batches, no grad."""

    def __init__(self, model_path: str | Path, *, batch_size: int = 64, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(str(model_path))
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device = device
        self.batch_size = batch_size

    def __call__(
        self, prompts: list[str], responses: list[str], answers: list[str | None]
    ) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size], return_tensors="pt", padding=True,
                    add_special_tokens=False,
                ).to(self.device)
                logits = self.model(**enc).logits.float()
                out += logits[:, -1].tolist()
        return out
