# Host-only tests of MoEBlaze.jl. UNTESTED itself: Julia is not installed on our machines.
# Run with: MOEBLAZE_LIBRARY=/path/to/libmoeblaze.so.0 julia --project=. -e 'using Pkg; Pkg.test()'
using Test
using MoEBlaze
using MoEBlaze: LibMoEBlaze
const L_ = LibMoEBlaze

@testset "MoEBlaze.jl" begin
    @testset "struct layouts" begin
        @test sizeof(L_.moeblaze_device_t) == 8
        @test sizeof(L_.moeblaze_dtype_t) == 4
        @test sizeof(L_.moeblaze_tensor_t) == 48
        @test fieldoffset(L_.moeblaze_tensor_t, 3) == 16   # ndim
        @test fieldoffset(L_.moeblaze_tensor_t, 5) == 24   # shape
        @test fieldoffset(L_.moeblaze_tensor_t, 7) == 40   # byte_offset
        @test sizeof(L_.moeblaze_arg_t) == 56
        @test fieldoffset(L_.moeblaze_arg_t, 3) == 8
        @test sizeof(L_.moeblaze_attr_info_t) == 64
        @test isbitstype(L_.moeblaze_tensor_t) && isbitstype(L_.moeblaze_arg_t)
    end

    @testset "version and status" begin
        @test MoEBlaze.abi_version() == L_.MOEBLAZE_ABI_VERSION
        @test MoEBlaze.version() == L_.MOEBLAZE_VERSION
        @test occursin(MoEBlaze.version_string(), MoEBlaze.build_info())
        @test MoEBlaze.status_name(1) == "MOEBLAZE_STATUS_INVALID_ARGUMENT"
        @test MoEBlaze.status_name(4242) == "MOEBLAZE_STATUS_UNKNOWN"
    end

    @testset "exported symbols" begin
        root = joinpath(@__DIR__, "..", "..", "..", "..")
        list = joinpath(root, "tests", "abi", "exported-symbols.txt")
        expected = if isfile(list)
            sort(filter(!isempty, strip.(readlines(list))))
        else
            text = read(joinpath(root, "src", "libmoeblaze.map"), String)
            globals = split(split(text, "global:")[2], "local:")[1]
            sort([m.match for m in eachmatch(r"moeblaze_\w+", globals)])
        end
        @test sort(string.(L_.WRAPPED)) == expected
    end

    @testset "config errors" begin
        cfg = Config()
        err = try
            MoEBlaze.setattr!(cfg, :top_k, 0); nothing
        catch e
            e
        end
        @test err isa MoEBlazeError
        @test err.status == L_.MOEBLAZE_STATUS_INVALID_ARGUMENT
        @test err.name == "MOEBLAZE_STATUS_INVALID_ARGUMENT"
        @test occursin("top_k", err.message)
        @test_throws ArgumentError MoEBlaze.setattr!(cfg, :no_such_attribute, 1)
        @test_throws MoEBlazeError Handle(cfg)   # required attributes missing
        destroy!(cfg)
        destroy!(cfg)                            # idempotent
    end

    @testset "CPU forward smoke test" begin
        E, k, d, h, L = 4, 2, 8, 12, 5
        hnd = Handle(; num_experts=E, top_k=k, hidden_size=d, ffn_hidden_size=h, max_tokens=16,
                     device_type=L_.MOEBLAZE_DEVICE_CPU, activation_dtype=:f32,
                     weight_dtype=:f32)
        @test MoEBlaze.getattr(hnd, :engine) == L_.MOEBLAZE_ENGINE_CPU
        x = randn(Float32, d, L)            # row-major [L, d]
        logits = randn(Float32, E, L)       # [L, E]
        wgu = 0.5f0 .* randn(Float32, 2h, d, E)   # [E, d, 2h]
        wd = 0.5f0 .* randn(Float32, d, h, E)     # [E, h, d]
        y = zeros(Float32, d, L)
        ids = zeros(Int64, k, L)
        args = [tensor(L_.MOEBLAZE_ARG_INPUT, x), tensor(L_.MOEBLAZE_ARG_ROUTER_LOGITS, logits),
                tensor(L_.MOEBLAZE_ARG_W_GATE_UP, wgu), tensor(L_.MOEBLAZE_ARG_W_DOWN, wd),
                tensor(L_.MOEBLAZE_ARG_OUTPUT, y), tensor(L_.MOEBLAZE_ARG_TOPK_INDICES, ids)]
        check_args(hnd, L_.MOEBLAZE_PASS_FORWARD_TRAINING, args)
        saved = forward!(hnd, L_.MOEBLAZE_PASS_FORWARD_TRAINING, args; num_tokens=L)
        @test all(isfinite, y)
        @test all(0 .<= ids .< E)
        # y_t = sum_j gate_tj * O_tj, checked for token 1 with the softmax gates.
        t = 1
        p = exp.(logits[:, t] .- maximum(logits[:, t])); p ./= sum(p)
        yref = zeros(Float64, d)
        for j in 1:k
            e = ids[j, t] + 1
            pre = [sum(Float64(x[i, t]) * wgu[c, i, e] for i in 1:d) for c in 1:2h]
            act = [pre[c] / (1 + exp(-pre[c])) * pre[h + c] for c in 1:h]
            yref .+= p[e] .* [sum(act[c] * wd[o, c, e] for c in 1:h) for o in 1:d]
        end
        @test isapprox(Float64.(y[:, t]), yref; rtol=1e-4)

        dy = randn(Float32, d, L)
        dx = zeros(Float32, d, L)
        bargs = [tensor(L_.MOEBLAZE_ARG_INPUT, x), tensor(L_.MOEBLAZE_ARG_ROUTER_LOGITS, logits),
                 tensor(L_.MOEBLAZE_ARG_W_GATE_UP, wgu), tensor(L_.MOEBLAZE_ARG_W_DOWN, wd),
                 tensor(L_.MOEBLAZE_ARG_GRAD_OUTPUT, dy), tensor(L_.MOEBLAZE_ARG_GRAD_INPUT, dx)]
        backward!(hnd, bargs, saved; num_tokens=L)
        @test all(isfinite, dx)
        destroy!(hnd)
    end
end
