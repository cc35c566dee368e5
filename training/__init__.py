"""tmod-train: data readers, layer-mix training, evaluation and reports (depends on server/)."""
