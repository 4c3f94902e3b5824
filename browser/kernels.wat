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

  ;; The sums of four i32x4 vectors, one per lane.
  (func $sum4 (param $a v128) (param $b v128) (param $c v128) (param $d v128) (result v128)
    (local $ab v128) (local $cd v128)
    (local.set $ab (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $a) (local.get $b))
                              (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $a) (local.get $b))))
    (local.set $cd (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $c) (local.get $d))
                              (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $c) (local.get $d))))
    (i32x4.add (i8x16.shuffle 0 1 2 3 8 9 10 11 16 17 18 19 24 25 26 27 (local.get $ab) (local.get $cd))
               (i8x16.shuffle 4 5 6 7 12 13 14 15 20 21 22 23 28 29 30 31 (local.get $ab) (local.get $cd))))

  (func $hsum_i32 (param $v v128) (result i32)
    (i32.add (i32.add (i32x4.extract_lane 0 (local.get $v)) (i32x4.extract_lane 1 (local.get $v)))
             (i32.add (i32x4.extract_lane 2 (local.get $v)) (i32x4.extract_lane 3 (local.get $v)))))

  (func $hsum_f32 (param $v v128) (result f32)
    (f32.add (f32.add (f32x4.extract_lane 0 (local.get $v)) (f32x4.extract_lane 1 (local.get $v)))
             (f32.add (f32x4.extract_lane 2 (local.get $v)) (f32x4.extract_lane 3 (local.get $v)))))

  ;; One 4-bit block's dot product with its 32 activation bytes, in four partial lanes.
  (func $dot4 (param $q i32) (param $a i32) (result v128)
    (local $w v128)
    (local.set $w (v128.load (local.get $q)))
    (i32x4.relaxed_dot_i8x16_i7x16_add_s
      (v128.load offset=16 (local.get $a))
      (i8x16.shr_u (local.get $w) (i32.const 4))
      (i32x4.relaxed_dot_i8x16_i7x16_add_s
        (v128.load (local.get $a))
        (v128.and (local.get $w) (v128.const i8x16 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15 15))
        (v128.const i32x4 0 0 0 0))))

  ;; One 8-bit block's dot product (signed codes) with its 32 activation bytes, in four partial lanes.
  (func $dot8 (param $q i32) (param $a i32) (result v128)
    (local $w v128) (local $x v128) (local $v v128) (local $y v128)
    (local.set $w (v128.load (local.get $q)))
    (local.set $x (v128.load (local.get $a)))
    (local.set $v (v128.load offset=16 (local.get $q)))
    (local.set $y (v128.load offset=16 (local.get $a)))
    (i32x4.add
      (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $w) (local.get $x)))
                 (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $w) (local.get $x))))
      (i32x4.add (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_low_i8x16_s (local.get $v) (local.get $y)))
                 (i32x4.extadd_pairwise_i16x8_s (i16x8.extmul_high_i8x16_s (local.get $v) (local.get $y))))))

  ;; out[r] = sum over blocks of row r (see the top). bits: 4 or 8; offsets: 0 where the matrix has none.
  ;; Pointers: codes (rows * nb * block bytes), scales and offsets (rows * nb f32), aq (nb * 32 int8), sa and asum
  ;; (nb f32), corr (nb i32), out (rows f32).
  (func (export "gemv") (param $bits i32) (param $codes i32) (param $scales i32) (param $offsets i32)
        (param $aq i32) (param $sa i32) (param $corr i32) (param $asum i32) (param $out i32)
        (param $rows i32) (param $nb i32)
    (local $r i32) (local $b i32) (local $q i32) (local $s i32) (local $o i32) (local $bytes i32) (local $nb4 i32)
    (local $acc v128) (local $tail f32) (local $dots v128) (local $dot i32)
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
      (block $groups_done (loop $groups_loop
        (br_if $groups_done (i32.ge_u (local.get $b) (local.get $nb4)))
        (if (i32.eq (local.get $bits) (i32.const 4))
          (then (local.set $dots (call $sum4
            (call $dot4 (local.get $q) (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5))))
            (call $dot4 (i32.add (local.get $q) (i32.const 16)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 1)) (i32.const 5))))
            (call $dot4 (i32.add (local.get $q) (i32.const 32)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 2)) (i32.const 5))))
            (call $dot4 (i32.add (local.get $q) (i32.const 48)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 3)) (i32.const 5)))))))
          (else (local.set $dots (call $sum4
            (call $dot8 (local.get $q) (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5))))
            (call $dot8 (i32.add (local.get $q) (i32.const 32)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 1)) (i32.const 5))))
            (call $dot8 (i32.add (local.get $q) (i32.const 64)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 2)) (i32.const 5))))
            (call $dot8 (i32.add (local.get $q) (i32.const 96)) (i32.add (local.get $aq) (i32.shl (i32.add (local.get $b) (i32.const 3)) (i32.const 5))))))))
        (local.set $dots (i32x4.sub (local.get $dots) (v128.load (i32.add (local.get $corr) (i32.shl (local.get $b) (i32.const 2))))))
        (local.set $acc (f32x4.add (local.get $acc)
          (f32x4.mul (f32x4.convert_i32x4_s (local.get $dots))
                     (f32x4.mul (v128.load (local.get $s)) (v128.load (i32.add (local.get $sa) (i32.shl (local.get $b) (i32.const 2))))))))
        (if (local.get $offsets)
          (then (local.set $acc (f32x4.add (local.get $acc)
            (f32x4.mul (v128.load (local.get $o)) (v128.load (i32.add (local.get $asum) (i32.shl (local.get $b) (i32.const 2)))))))))
        (local.set $q (i32.add (local.get $q) (i32.shl (local.get $bytes) (i32.const 2))))
        (local.set $s (i32.add (local.get $s) (i32.const 16)))
        (local.set $o (i32.add (local.get $o) (i32.const 16)))
        (local.set $b (i32.add (local.get $b) (i32.const 4)))
        (br $groups_loop)))
      (block $tail_done (loop $tail_loop
        (br_if $tail_done (i32.ge_u (local.get $b) (local.get $nb)))
        (local.set $dot (i32.sub
          (call $hsum_i32 (if (result v128) (i32.eq (local.get $bits) (i32.const 4))
            (then (call $dot4 (local.get $q) (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5)))))
            (else (call $dot8 (local.get $q) (i32.add (local.get $aq) (i32.shl (local.get $b) (i32.const 5)))))))
          (i32.load (i32.add (local.get $corr) (i32.shl (local.get $b) (i32.const 2))))))
        (local.set $tail (f32.add (local.get $tail)
          (f32.mul (f32.convert_i32_s (local.get $dot))
                   (f32.mul (f32.load (local.get $s)) (f32.load (i32.add (local.get $sa) (i32.shl (local.get $b) (i32.const 2))))))))
        (if (local.get $offsets)
          (then (local.set $tail (f32.add (local.get $tail)
            (f32.mul (f32.load (local.get $o)) (f32.load (i32.add (local.get $asum) (i32.shl (local.get $b) (i32.const 2)))))))))
        (local.set $q (i32.add (local.get $q) (local.get $bytes)))
        (local.set $s (i32.add (local.get $s) (i32.const 4)))
        (local.set $o (i32.add (local.get $o) (i32.const 4)))
        (local.set $b (i32.add (local.get $b) (i32.const 1)))
        (br $tail_loop)))
      (f32.store (i32.add (local.get $out) (i32.shl (local.get $r) (i32.const 2)))
                 (f32.add (call $hsum_f32 (local.get $acc)) (local.get $tail)))
      (local.set $r (i32.add (local.get $r) (i32.const 1)))
      (br $rows_loop)))))
