//! Adds an rpath to this package's own tests and examples, from the directory that
//! moeblaze-sys found (its `links = "moeblaze"` metadata, `DEP_MOEBLAZE_LIB_DIR`), so that
//! `cargo test` runs without LD_LIBRARY_PATH. Nothing is added to dependents' binaries.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MOEBLAZE_LIB_DIR");
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(dir) = std::env::var("DEP_MOEBLAZE_LIB_DIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
