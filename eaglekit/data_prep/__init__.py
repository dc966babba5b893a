"""Data preparation: conversations → loss-masked tokens → (regenerated answers) → draft vocab → features.

Public API (the contract the trainer relies on)::

    from eaglekit.data_prep import read_conversations, tokenize_conversation, build_draft_vocab, \
        FeatureDataset, OnlineFeatures
"""

from eaglekit.data_prep.capture import capture_features, compute_features, feature_bytes_per_token
from eaglekit.data_prep.conversations import (
    ConversationError,
    Conversations,
    load_sharegpt,
    normalise_messages,
    read_conversations,
)
from eaglekit.data_prep.dataset import FeatureDataset, FeatureError, OnlineFeatures, check_manifest
from eaglekit.data_prep.template import (
    TemplateError,
    template_hash,
    tokenize_conversation,
    tokenize_conversations,
)
from eaglekit.data_prep.vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab, token_counts

__all__ = [
    "ConversationError",
    "Conversations",
    "FeatureDataset",
    "FeatureError",
    "OnlineFeatures",
    "TemplateError",
    "build_draft_vocab",
    "capture_features",
    "check_manifest",
    "compute_features",
    "feature_bytes_per_token",
    "load_draft_vocab",
    "load_sharegpt",
    "normalise_messages",
    "read_conversations",
    "save_draft_vocab",
    "template_hash",
    "token_counts",
    "tokenize_conversation",
    "tokenize_conversations",
]
