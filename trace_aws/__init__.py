"""trace_aws: the AWS adapters (SQS, KMS, STS, Lambda, S3) of the trace_core ports."""
