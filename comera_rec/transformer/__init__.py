"""Transformer backbones on the shared tensor core: a BERT-style sentence-pair classifier
and a RoBERTa-style (CodeBERT) masked-LM, with dense, GaLore and LTE baselines."""
