module github.com/watermill-idempotency/idempotency/examples/demo/kafkapeer

go 1.26.0

require github.com/twmb/franz-go/pkg/kfake v0.0.0-20260918054303-01f206a7e32c

require (
	github.com/klauspost/compress v1.20.0 // indirect
	github.com/pierrec/lz4/v4 v4.1.30 // indirect
	github.com/twmb/franz-go v1.21.7 // indirect
	github.com/twmb/franz-go/pkg/kmsg v1.14.0 // indirect
)
