"""trace_aws: AWS adapters (SQS, KMS, STS, Lambda, S3) of the trace_core ports. Arrives in a later issue."""
