"""A stand-in for SageMaker's training toolkit: :mod:`sagemaker_training.environment` only."""
