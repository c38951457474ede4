"""Training on the engine's model: the prerouter heads (heads), the recovery LoRA
(recovery_lora, lora_checkpoint), the merge loss that ranks experts by it (merge_loss), and the
quality measures the training and the reports use (quality)."""
