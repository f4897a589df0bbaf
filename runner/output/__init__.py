"""What a run leaves for people: the model, its metrics, its trackers.

    export.py    a checkpoint -> a Hugging Face directory or a PEFT adapter that loads without jobspec
    metrics.py   metrics.jsonl, the log line, the progress bar
    tracking.py  TensorBoard, W&B and MLflow through accelerate's tracker classes
"""
