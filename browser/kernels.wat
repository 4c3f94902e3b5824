;; Matrix-vector products over block-quantized matrices for the browser node (kernels.js), in WebAssembly SIMD.
;;
;; A matrix is stored as onnx_graph's affine blocks: per row, blocks of 32 columns, each with integer codes, a scale
;; and an offset: w = scale * (code - mid) + offset. The activation comes quantized per block of 32 to int8 with
;; its own scale (kernels.js quantize), as onnxruntime's MatMulNBits does with int8 activations, so a block's
;; contribution is
;;   scale * a_scale * (sum(code * a_q) - corr) + offset * a_sum
;; with corr = mid * sum(a_q) and a_sum the float sum of the activation block. The integer sums are exact; only the
;; float accumulation differs from the native kernel's order.
;;
;; gemv4: 4-bit codes, 16 bytes a block, byte j holding column j (low nibble) and column j + 16 (high nibble), the
;;   GGUF Q4 order. The codes (0..15) are the 7-bit operand of the relaxed integer dot product: 16 products a
;;   instruction, where plain SIMD has none for bytes.
;; gemv8: 8-bit codes stored signed (code - 128), 32 bytes a block; corr is zero.
;; Four blocks go at a time: their four dot vectors are summed lane-wise into one, whose lanes are the four blocks.
;; Rows with a tail of fewer than four blocks finish it one block at a time.
(module
  (memory (export "memory") 1 65536)

  (func $hsum_i32 (param $v v128) (result i32)
    (i32.add (i32.add (i32x4.extract_lane 0 (local.get $v)) (i32x4.extract_lane 1 (local.get $v)))
             (i32.add (i32x4.extract_lane 2 (local.get $v)) (i32x4.extract_lane 3 (local.get $v)))))

  (func $hsum_f32 (param $v v128) (result f32)
    (f32.add (f32.add (f32x4.extract_lane 0 (local.get $v)) (f32x4.extract_lane 1 (local.get $v)))
             (f32.add (f32x4.extract_lane 2 (local.get $v)) (f32x4.extract_lane 3 (local.get $v)))))

  ;; One block's dot product with its 32 activation bytes, in four partial lanes (the rows' tails).
  (func $dot (param $bits i32) (param $q i32) (param $a i32) (result v128)
    (local $w v128) (local $v v128)
    (if (result v128) (i32.eq (local.get $bits) (i32.const 4))
      (then
        (local.set $w (v128.load (local.get $q)))
        (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=16 (local.get $a))
          (i8x16.shr_u (local.get $w) (i32.const 4))
          (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load (local.get $a))
            (v128.and (local.get $w) (v128.const i8x16 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15))
            (v128.const i32x4 0 0 0 0))))
      (else
        (local.set $w (v128.load (local.get $q)))
        (local.set $v (v128.load offset=16 (local.get $q)))
        (i32x4.add
          (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (v128.load (local.get $a))))
                     (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (v128.load (local.get $a)))))
          (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (v128.load offset=16 (local.get $a))))
                     (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (v128.load offset=16 (local.get $a)))))))))

  ;; out[r] = sum over blocks of row r (see the top). bits: 4 or 8; offsets: 0 where the matrix has none.
  ;; Pointers: codes (rows * nb * block bytes), scales and offsets (rows * nb f32), aq (nb * 32 int8), sa and asum
  ;; (nb f32), corr (nb i32), out (rows f32). The four blocks of a group are written out in full (no calls): the
  ;; engine's inlining is not to be relied on (with calls, this ran at 2.9 GMAC/s against 6.5 inline).
  (func (export "gemv") (param $bits i32) (param $codes i32) (param $scales i32) (param $offsets i32)
        (param $aq i32) (param $sa i32) (param $corr i32) (param $asum i32) (param $out i32)
        (param $rows i32) (param $nb i32)
    (local $r i32) (local $b i32) (local $q i32) (local $a i32) (local $s i32) (local $o i32) (local $bytes i32)
    (local $nb4 i32) (local $acc v128) (local $tail f32) (local $dot i32) (local $low v128)
    (local $w v128) (local $x v128) (local $v v128) (local $y v128)
    (local $t0 v128) (local $t1 v128) (local $t2 v128) (local $t3 v128)
    (local.set $low (v128.const i8x16 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15))
    (local.set $bytes (select (i32.const 16) (i32.const 32) (i32.eq (local.get $bits) (i32.const 4))))
    (local.set $nb4 (i32.and (local.get $nb) (i32.const -4)))
    (local.set $q (local.get $codes))
    (local.set $s (local.get $scales))
    (local.set $o (local.get $offsets))
    (block $rows_done (loop $rows_loop
      (br_if $rows_done (i32.ge_u (local.get $r) (local.get $rows)))
      (local.set $acc (v128.const f32x4 0 0 0 0))
      (local.set $tail (f32.const 0))
      (local.set $b (i32.const 0))
      (local.set $a (local.get $aq))
      (block $groups_done (loop $groups_loop
        (br_if $groups_done (i32.ge_u (local.get $b) (local.get $nb4)))
        (if (i32.eq (local.get $bits) (i32.const 4))
          (then
            (local.set $w (v128.load offset=0 (local.get $q)))
            (local.set $t0 (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=16 (local.get $a))
              (i8x16.shr_u (local.get $w) (i32.const 4))
              (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=0 (local.get $a))
                (v128.and (local.get $w) (local.get $low)) (v128.const i32x4 0 0 0 0))))
            (local.set $w (v128.load offset=16 (local.get $q)))
            (local.set $t1 (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=48 (local.get $a))
              (i8x16.shr_u (local.get $w) (i32.const 4))
              (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=32 (local.get $a))
                (v128.and (local.get $w) (local.get $low)) (v128.const i32x4 0 0 0 0))))
            (local.set $w (v128.load offset=32 (local.get $q)))
            (local.set $t2 (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=80 (local.get $a))
              (i8x16.shr_u (local.get $w) (i32.const 4))
              (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=64 (local.get $a))
                (v128.and (local.get $w) (local.get $low)) (v128.const i32x4 0 0 0 0))))
            (local.set $w (v128.load offset=48 (local.get $q)))
            (local.set $t3 (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=112 (local.get $a))
              (i8x16.shr_u (local.get $w) (i32.const 4))
              (i32x4.relaxed_dot_i8x16_i7x16_add_s (v128.load offset=96 (local.get $a))
                (v128.and (local.get $w) (local.get $low)) (v128.const i32x4 0 0 0 0)))))
          (else
            (local.set $w (v128.load offset=0 (local.get $q)))
            (local.set $x (v128.load offset=0 (local.get $a)))
            (local.set $v (v128.load offset=16 (local.get $q)))
            (local.set $y (v128.load offset=16 (local.get $a)))
            (local.set $t0 (i32x4.add
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (local.get $x)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (local.get $x))))
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (local.get $y)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (local.get $y))))))
            (local.set $w (v128.load offset=32 (local.get $q)))
            (local.set $x (v128.load offset=32 (local.get $a)))
            (local.set $v (v128.load offset=48 (local.get $q)))
            (local.set $y (v128.load offset=48 (local.get $a)))
            (local.set $t1 (i32x4.add
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (local.get $x)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (local.get $x))))
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (local.get $y)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (local.get $y))))))
            (local.set $w (v128.load offset=64 (local.get $q)))
            (local.set $x (v128.load offset=64 (local.get $a)))
            (local.set $v (v128.load offset=80 (local.get $q)))
            (local.set $y (v128.load offset=80 (local.get $a)))
            (local.set $t2 (i32x4.add
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (local.get $x)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (local.get $x))))
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (local.get $y)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (local.get $y))))))
            (local.set $w (v128.load offset=96 (local.get $q)))
            (local.set $x (v128.load offset=96 (local.get $a)))
            (local.set $v (v128.load offset=112 (local.get $q)))
            (local.set $y (v128.load offset=112 (local.get $a)))
            (local.set $t3 (i32x4.add
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (local.get $x)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (local.get $x))))
              (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (local.get $y)))
                         (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (local.get $y))))))))
        ;; t0..t3 -> one vector whose lane k is block k's sum.
        (local.set $t0 (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $t0) (local.get $t1))
                                  (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $t0) (local.get $t1))))
        (local.set $t2 (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $t2) (local.get $t3))
                                  (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $t2) (local.get $t3))))
        (local.set $t0 (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $t0) (local.get $t2))
                                  (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $t0) (local.get $t2))))
        (local.set $t0 (i32x4.sub (local.get $t0) (v128.load (i32.add (local.get $corr) (i32.shl (local.get $b) (i32.const 2))))))
        (local.set $acc (f32x4.add (local.get $acc)
          (f32x4.mul (f32x4.convert_i32x4_s (local.get $t0))
                     (f32x4.mul (v128.load (local.get $s)) (v128.load (i32.add (local.get $sa) (i32.shl (local.get $b) (i32.const 2))))))))
        (if (local.get $offsets)
          (then (local.set $acc (f32x4.add (local.get $acc)
            (f32x4.mul (v128.load (local.get $o)) (v128.load (i32.add (local.get $asum) (i32.shl (local.get $b) (i32.const 2)))))))))
        (local.set $q (i32.add (local.get $q) (i32.shl (local.get $bytes) (i32.const 2))))
        (local.set $a (i32.add (local.get $a) (i32.const 128)))
        (local.set $s (i32.add (local.get $s) (i32.const 16)))
        (local.set $o (i32.add (local.get $o) (i32.const 16)))
        (local.set $b (i32.add (local.get $b) (i32.const 4)))
        (br $groups_loop)))
      (block $tail_done (loop $tail_loop
        (br_if $tail_done (i32.ge_u (local.get $b) (local.get $nb)))
        (local.set $dot (i32.sub (call $hsum_i32 (call $dot (local.get $bits) (local.get $q) (local.get $a)))
                                 (i32.load (i32.add (local.get $corr) (i32.shl (local.get $b) (i32.const 2))))))
        (local.set $tail (f32.add (local.get $tail)
          (f32.mul (f32.convert_i32_s (local.get $dot))
                   (f32.mul (f32.load (local.get $s)) (f32.load (i32.add (local.get $sa) (i32.shl (local.get $b) (i32.const 2))))))))
        (if (local.get $offsets)
          (then (local.set $tail (f32.add (local.get $tail)
            (f32.mul (f32.load (local.get $o)) (f32.load (i32.add (local.get $asum) (i32.shl (local.get $b) (i32.const 2)))))))))
        (local.set $q (i32.add (local.get $q) (local.get $bytes)))
        (local.set $a (i32.add (local.get $a) (i32.const 32)))
        (local.set $s (i32.add (local.get $s) (i32.const 4)))
        (local.set $o (i32.add (local.get $o) (i32.const 4)))
        (local.set $b (i32.add (local.get $b) (i32.const 1)))
        (br $tail_loop)))
      (f32.store (i32.add (local.get $out) (i32.shl (local.get $r) (i32.const 2)))
                 (f32.add (call $hsum_f32 (local.get $acc)) (local.get $tail)))
      (local.set $r (i32.add (local.get $r) (i32.const 1)))
      (br $rows_loop))))

  ;; The activation x (nb blocks of 32 f32) into the products' form: per block scale = max|x| / 127, codes
  ;; x * (127 / max|x|) rounded to nearest even (aq), corr = mid * sum of the codes, asum = the float sum of x.
  (func (export "quantize") (param $x i32) (param $nb i32) (param $mid i32) (param $aq i32) (param $sa i32)
        (param $corr i32) (param $asum i32)
    (local $b i32) (local $p i32) (local $j i32) (local $amax v128) (local $sum v128) (local $m f32)
    (local $inverse v128) (local $codes v128) (local $i0 v128) (local $i1 v128) (local $i2 v128) (local $i3 v128)
    (local $count v128)
    (block $done (loop $blocks
      (br_if $done (i32.ge_u (local.get $b) (local.get $nb)))
      (local.set $p (i32.add (local.get $x) (i32.shl (local.get $b) (i32.const 7))))
      (local.set $amax (v128.const f32x4 0 0 0 0))
      (local.set $sum (v128.const f32x4 0 0 0 0))
      (local.set $j (i32.const 0))
      (block $max_done (loop $max_loop
        (br_if $max_done (i32.ge_u (local.get $j) (i32.const 128)))
        (local.set $amax (f32x4.max (local.get $amax) (f32x4.abs (v128.load (i32.add (local.get $p) (local.get $j))))))
        (local.set $j (i32.add (local.get $j) (i32.const 16)))
        (br $max_loop)))
      (local.set $m (f32.max (f32.max (f32x4.extract_lane 0 (local.get $amax)) (f32x4.extract_lane 1 (local.get $amax)))
                             (f32.max (f32x4.extract_lane 2 (local.get $amax)) (f32x4.extract_lane 3 (local.get $amax)))))
      (f32.store (i32.add (local.get $sa) (i32.shl (local.get $b) (i32.const 2))) (f32.div (local.get $m) (f32.const 127)))
      (local.set $inverse (f32x4.splat (select (f32.div (f32.const 127) (local.get $m)) (f32.const 0)
                                               (f32.gt (local.get $m) (f32.const 0)))))
      (local.set $i0 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load (local.get $p)) (local.get $inverse)))))
      (local.set $i1 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=16 (local.get $p)) (local.get $inverse)))))
      (local.set $i2 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=32 (local.get $p)) (local.get $inverse)))))
      (local.set $i3 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=48 (local.get $p)) (local.get $inverse)))))
      (local.set $count (i32x4.add (i32x4.add (local.get $i0) (local.get $i1)) (i32x4.add (local.get $i2) (local.get $i3))))
      (v128.store (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5)))
        (i8x16.narrow_i16x8_s (i16x8.narrow_i32x4_s (local.get $i0) (local.get $i1))
                              (i16x8.narrow_i32x4_s (local.get $i2) (local.get $i3))))
      (local.set $i0 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=64 (local.get $p)) (local.get $inverse)))))
      (local.set $i1 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=80 (local.get $p)) (local.get $inverse)))))
      (local.set $i2 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=96 (local.get $p)) (local.get $inverse)))))
      (local.set $i3 (i32x4.trunc_sat_f32x4_s (f32x4.nearest (f32x4.mul (v128.load offset=112 (local.get $p)) (local.get $inverse)))))
      (local.set $count (i32x4.add (local.get $count)
        (i32x4.add (i32x4.add (local.get $i0) (local.get $i1)) (i32x4.add (local.get $i2) (local.get $i3)))))
      (v128.store offset=16 (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5)))
        (i8x16.narrow_i16x8_s (i16x8.narrow_i32x4_s (local.get $i0) (local.get $i1))
                              (i16x8.narrow_i32x4_s (local.get $i2) (local.get $i3))))
      (i32.store (i32.add (local.get $corr) (i32.shl (local.get $b) (i32.const 2)))
                 (i32.mul (local.get $mid) (call $hsum_i32 (local.get $count))))
      ;; The float sum in order, element by element, as the numpy replica's float64 sum rounds to the same float32
      ;; only to within an ulp: it weighs the offsets, a 32x smaller term.
      (local.set $j (i32.const 0))
      (block $sum_done (loop $sum_loop
        (br_if $sum_done (i32.ge_u (local.get $j) (i32.const 128)))
        (local.set $sum (f32x4.add (local.get $sum) (v128.load (i32.add (local.get $p) (local.get $j)))))
        (local.set $j (i32.add (local.get $j) (i32.const 16)))
        (br $sum_loop)))
      (f32.store (i32.add (local.get $asum) (i32.shl (local.get $b) (i32.const 2))) (call $hsum_f32 (local.get $sum)))
      (local.set $b (i32.add (local.get $b) (i32.const 1)))
      (br $blocks))))

  ;; Attention scores of one head: out[t] = (q . keys[t]) * scale for t < positions; head_dim a multiple of 4.
  (func (export "scores") (param $q i32) (param $keys i32) (param $out i32) (param $positions i32)
        (param $dim i32) (param $scale f32)
    (local $t i32) (local $j i32) (local $k i32) (local $acc v128)
    (block $done (loop $rows
      (br_if $done (i32.ge_u (local.get $t) (local.get $positions)))
      (local.set $acc (v128.const f32x4 0 0 0 0))
      (local.set $j (i32.const 0))
      (local.set $k (i32.add (local.get $keys) (i32.shl (i32.mul (local.get $t) (local.get $dim)) (i32.const 2))))
      (block $dot_done (loop $dot
        (br_if $dot_done (i32.ge_u (local.get $j) (i32.shl (local.get $dim) (i32.const 2))))
        (local.set $acc (f32x4.add (local.get $acc) (f32x4.mul (v128.load (i32.add (local.get $q) (local.get $j)))
                                                               (v128.load (i32.add (local.get $k) (local.get $j))))))
        (local.set $j (i32.add (local.get $j) (i32.const 16)))
        (br $dot)))
      (f32.store (i32.add (local.get $out) (i32.shl (local.get $t) (i32.const 2)))
                 (f32.mul (call $hsum_f32 (local.get $acc)) (local.get $scale)))
      (local.set $t (i32.add (local.get $t) (i32.const 1)))
      (br $rows))))

  ;; One head's attention output: out = sum over t < positions of weights[t] * values[t]; head_dim a multiple of 4.
  (func (export "mix") (param $weights i32) (param $values i32) (param $out i32) (param $positions i32)
        (param $dim i32)
    (local $t i32) (local $j i32) (local $v i32) (local $w v128)
    (local.set $j (i32.const 0))
    (block $zero_done (loop $zero
      (br_if $zero_done (i32.ge_u (local.get $j) (i32.shl (local.get $dim) (i32.const 2))))
      (v128.store (i32.add (local.get $out) (local.get $j)) (v128.const f32x4 0 0 0 0))
      (local.set $j (i32.add (local.get $j) (i32.const 16)))
      (br $zero)))
    (block $done (loop $rows
      (br_if $done (i32.ge_u (local.get $t) (local.get $positions)))
      (local.set $w (f32x4.splat (f32.load (i32.add (local.get $weights) (i32.shl (local.get $t) (i32.const 2))))))
      (local.set $v (i32.add (local.get $values) (i32.shl (i32.mul (local.get $t) (local.get $dim)) (i32.const 2))))
      (local.set $j (i32.const 0))
      (block $row_done (loop $row
        (br_if $row_done (i32.ge_u (local.get $j) (i32.shl (local.get $dim) (i32.const 2))))
        (v128.store (i32.add (local.get $out) (local.get $j))
          (f32x4.add (v128.load (i32.add (local.get $out) (local.get $j)))
                     (f32x4.mul (local.get $w) (v128.load (i32.add (local.get $v) (local.get $j))))))
        (local.set $j (i32.add (local.get $j) (i32.const 16)))
        (br $row)))
      (local.set $t (i32.add (local.get $t) (i32.const 1)))
      (br $rows)))))
