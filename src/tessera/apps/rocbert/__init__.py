"""ROCBERT (robust Chinese BERT): multimodal character features, adversarial synthesis and
contrastive pretraining on transformers' RoCBert classes, trained with tessera.boost."""
