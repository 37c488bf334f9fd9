//! kiln-serve over gRPC (tonic client from the same proto): metadata, config, raw and typed
//! tensor contents, error codes for malformed requests and overload.

mod common;

use common::{
    TestServer, f32_bytes, grpc_request as request, images, tempdir, write_cnn_model, write_model,
};
use kiln_serve::grpc::pb;
use pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use tonic::Code;

type Client = GrpcInferenceServiceClient<tonic::transport::Channel>;

#[test]
fn grpc_serves_metadata_config_and_inference() {
    let repo = tempdir("grpc");
    let graph = write_cnn_model(
        &repo,
        "w3",
        "max_batch_size = 8\ninstances = 2\n\
         [dynamic_batching]\nmax_queue_delay_microseconds = 100\npreferred_batch_size = [4, 8]\n",
    );
    write_model(&repo, "broken", "backend = \"zoo\"\nmodel = \"cnn\"\n");
    let server = TestServer::start(&repo);
    let addr = format!("http://{}", server.grpc);
    server.runtime.block_on(async {
        let mut c: Client = GrpcInferenceServiceClient::connect(addr).await.unwrap();
        assert!(
            c.server_live(pb::ServerLiveRequest {})
                .await
                .unwrap()
                .into_inner()
                .live
        );
        assert!(
            c.server_ready(pb::ServerReadyRequest {})
                .await
                .unwrap()
                .into_inner()
                .ready
        );
        let ready = |name: &str| pb::ModelReadyRequest {
            name: name.into(),
            version: String::new(),
        };
        assert!(c.model_ready(ready("w3")).await.unwrap().into_inner().ready);
        assert!(
            !c.model_ready(ready("broken"))
                .await
                .unwrap()
                .into_inner()
                .ready
        );
        assert_eq!(
            c.model_ready(ready("nope")).await.unwrap_err().code(),
            Code::NotFound
        );

        let meta = c
            .model_metadata(pb::ModelMetadataRequest {
                name: "w3".into(),
                version: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(meta.inputs[0].shape, vec![-1, 1, 28, 28]);
        assert_eq!(meta.outputs[0].name, "logits");
        let config = common::grpc_model_config(&mut c, "w3").await;
        assert_eq!(config.max_batch_size, 8);
        assert_eq!(config.instance_group[0].count, 2);
        match config.scheduling_choice {
            Some(pb::model_config::SchedulingChoice::DynamicBatching(b)) => {
                assert_eq!(b.preferred_batch_size, vec![4, 8]);
                assert_eq!(b.max_queue_delay_microseconds, 100);
            }
            other => panic!("no dynamic batching in {other:?}"),
        }

        // Raw contents, batch of 3: logits match the graph run alone.
        let x = images(7, 3);
        let resp = c
            .model_infer(request("w3", "images", vec![3, 1, 28, 28], f32_bytes(&x)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.id, "req");
        assert_eq!(resp.outputs[0].shape, vec![3, 10]);
        assert_eq!(resp.outputs[1].datatype, "INT64");
        let logits: Vec<f32> = resp.raw_output_contents[0]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let reference = common::reference_logits(&graph, &x, 3);
        for (a, b) in logits.iter().zip(&reference) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }

        // Typed contents, one requested output.
        let mut typed = request("w3", "images", vec![1, 1, 28, 28], Vec::new());
        typed.raw_input_contents.clear();
        typed.inputs[0].contents = Some(pb::InferTensorContents {
            fp32_contents: images(8, 1),
            ..Default::default()
        });
        typed.outputs = vec![pb::model_infer_request::InferRequestedOutputTensor {
            name: "label".into(),
            ..Default::default()
        }];
        let resp = c.model_infer(typed).await.unwrap().into_inner();
        assert_eq!(resp.outputs.len(), 1);
        assert_eq!(resp.outputs[0].name, "label");
        assert_eq!(resp.raw_output_contents[0].len(), 8);

        // Errors carry codes and messages.
        let cases = [
            (
                request("w3", "images", vec![1, 1, 28], vec![0; 3136]),
                Code::InvalidArgument,
                "expects",
            ),
            (
                request("w3", "images", vec![1, 1, 28, 28], vec![0; 10]),
                Code::InvalidArgument,
                "whole number",
            ),
            (
                request("w3", "x", vec![1, 1, 28, 28], vec![0; 3136]),
                Code::InvalidArgument,
                "unexpected input",
            ),
            (
                request("nope", "images", vec![1, 1, 28, 28], vec![0; 3136]),
                Code::NotFound,
                "unknown model",
            ),
            (
                request("broken", "images", vec![1, 1, 28, 28], vec![0; 3136]),
                Code::FailedPrecondition,
                "needs `checkpoint`",
            ),
        ];
        let mut negative_timeout = request("w3", "images", vec![1, 1, 28, 28], vec![0; 3136]);
        negative_timeout.parameters.insert(
            "timeout".into(),
            pb::InferParameter {
                parameter_choice: Some(pb::infer_parameter::ParameterChoice::Int64Param(-5)),
            },
        );
        let cases = cases.into_iter().chain([(
            negative_timeout,
            Code::InvalidArgument,
            "parameter `timeout`",
        )]);
        for (req, code, phrase) in cases {
            let e = c.model_infer(req).await.unwrap_err();
            assert_eq!(e.code(), code, "{}", e.message());
            assert!(
                e.message().contains(phrase),
                "{:?} lacks {phrase:?}",
                e.message()
            );
        }
        let stats = c
            .model_statistics(pb::ModelStatisticsRequest {
                name: "w3".into(),
                version: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let s = &stats.model_stats[0];
        assert_eq!(s.inference_count, 4);
        let inference = s.inference_stats.as_ref().unwrap();
        assert_eq!(inference.success.as_ref().unwrap().count, 2);
        assert_eq!(inference.fail.as_ref().unwrap().count, 4);
        let index = c
            .repository_index(pb::RepositoryIndexRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(index.models[0].state, "UNAVAILABLE");
        assert!(index.models[0].reason.contains("checkpoint"));
    });
}

#[test]
fn grpc_overload_is_resource_exhausted_and_counts_add_up() {
    let repo = tempdir("grpc-overload");
    write_model(
        &repo,
        "slow",
        "backend = \"identity\"\ndims = [1]\nexecute_delay_microseconds = 20000\nmax_queue_size = 2\n",
    );
    let server = TestServer::start(&repo);
    let addr = format!("http://{}", server.grpc);
    let n = 30;
    let codes: Vec<Code> = server.runtime.block_on(async {
        let c: Client = GrpcInferenceServiceClient::connect(addr).await.unwrap();
        let calls: Vec<_> = (0..n)
            .map(|i| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    c.model_infer(request(
                        "slow",
                        "INPUT0",
                        vec![1, 1],
                        f32_bytes(&[i as f32]),
                    ))
                    .await
                    .map_or_else(|e| e.code(), |_| Code::Ok)
                })
            })
            .collect();
        let mut codes = Vec::new();
        for call in calls {
            codes.push(call.await.unwrap());
        }
        codes
    });
    let ok = codes.iter().filter(|&&c| c == Code::Ok).count();
    let exhausted = codes
        .iter()
        .filter(|&&c| c == Code::ResourceExhausted)
        .count();
    assert_eq!(
        ok + exhausted,
        n,
        "every call answered OK or RESOURCE_EXHAUSTED: {codes:?}"
    );
    assert!(ok >= 1 && exhausted >= 1, "{ok} ok, {exhausted} rejected");
    assert_eq!(
        server.model("slow").metrics.failures("queue_full"),
        exhausted as u64
    );
}

/// `--max-body-bytes` holds on gRPC as on HTTP: a message above it is refused before it is
/// decoded, naming the limit; one below it is served.
#[test]
fn grpc_messages_obey_the_body_limit_http_has() {
    let repo = tempdir("grpc-limit");
    write_cnn_model(&repo, "w3", "max_batch_size = 64\n");
    let limit = 64 << 10;
    let server = TestServer::start_with(&repo, limit);
    let addr = format!("http://{}", server.grpc);
    server.runtime.block_on(async {
        let mut c: Client = GrpcInferenceServiceClient::connect(addr).await.unwrap();
        // 4 images: 12.5 KiB of tensor data, under the limit.
        let small = request("w3", "images", vec![4, 1, 28, 28], f32_bytes(&images(1, 4)));
        assert!(c.model_infer(small).await.is_ok());
        // 32 images: 98 KiB, over it.
        let large = request(
            "w3",
            "images",
            vec![32, 1, 28, 28],
            f32_bytes(&images(2, 32)),
        );
        let err = c.model_infer(large).await.unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "{}", err.message());
        assert!(
            err.message().contains(&limit.to_string()),
            "{}",
            err.message()
        );
    });
    // The same body size on HTTP is refused too, with the flag that raises it.
    let body = common::infer_body("images", &[32, 1, 28, 28], &images(2, 32));
    let r = common::post_json(server.http, "/v2/models/w3/infer", &body);
    assert_eq!(r.status, 400);
    assert!(r.error().contains("--max-body-bytes"), "{}", r.error());
}
