"""vision_worker: image preprocessing, vision tower and projector; ships image embeddings to prefill
through kv_transfer. Filled by the vision-stage issue."""
