"""The tiny DLRM run shared by trainer tests: small tables and MLPs, steps of milliseconds."""

TABLE_SIZES = [
    20000,
    15000,
    300,
    40,
    12000,
    7,
    500,
    60,
    3,
    900,
    20,
    11,
    50,
    4,
    1000,
    30000,
    8,
    100,
    70,
    4,
    9000,
    10,
    12,
    800,
    90,
    200,
]
# Tables 0, 1, 4 and 15 reach min_rows_to_compress and are TT-compressed.
TINY = [
    f"model.table_sizes=[{','.join(map(str, TABLE_SIZES))}]",
    "model.embedding_dim=8",
    "model.bottom_mlp=[64,32,8]",
    "model.top_mlp=[64,32,1]",
    "model.rank=4",
    "model.mlp_rank=4",
    "model.min_rows_to_compress=10000",
    "model.min_params_to_compress=0",
    "data.batch_size=256",
    "data.synthetic_train_rows=65536",
    "data.synthetic_val_rows=4096",
    "trainer.progress=false",
    "trainer.log_every=1",
]
# Every table large enough to compress: no dense TorchRec table is left for FBGEMM's kernels
# (whose CUDA build a GPU machine may lack).
ALL_TT = [f"model.table_sizes=[{','.join(['20000'] * 2 + ['1000'] * 24)}]", "model.min_rows_to_compress=1"]
# 20 steps through two rank cuts, no plots, no final checkpoint: the graphed-loop tests' run.
TWO_CUTS = [
    "schedule.mode=threshold",
    "schedule.threshold=0.999",
    "schedule.truncate_every=8",
    "trainer.max_steps=20",
    "trainer.plots=false",
    "trainer.checkpoint_at_end=false",
]
