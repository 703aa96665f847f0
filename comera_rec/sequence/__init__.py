"""A BERT4Rec-style masked-item sequence recommender on the TorchRec integration: item
embeddings in an ``EmbeddingCollection`` (dense) or a ``TTMEmbeddingCollection`` (TT),
a small transformer encoder, and full-catalogue scoring against the item table; trained
by the engine on synthetic Markov sessions or MovieLens-style interaction files."""
