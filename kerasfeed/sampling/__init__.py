"""Index order: which item comes when, in every pass over a source."""
